"""What every run shares, under one name each: the model, the steps, the seed, the trainer and its procs, the task
and its rewards, evaluation, checkpoints, the output folder and the launcher. GRPOConfig (and PPO's and
distillation's, which derive from it) and SFTConfig derive from `RunConfig`; a recipe redeclares a field only to
give it another default. Torch-free: a config is read and checked before anything heavy is imported.

A config class may name keys it no longer has in `RENAMED` (old key -> new key): forge_rl/config.py refuses
them, in a file or on the command line, in one line naming the new key."""

from dataclasses import dataclass, field
from typing import ClassVar

from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.config import ConfigError
from forge_rl.data.task import TaskConfig
from forge_rl.launch.launcher_config import LauncherConfig
from forge_rl.rewards.reward_config import RewardConfig


@dataclass
class RunConfig:
    RENAMED: ClassVar[dict[str, str]] = {}

    model: str = "tiny-warm"  # "tiny", "tiny-warm" or a local HF model directory
    steps: int = 100  # optimizer steps in total (a resumed run continues up to this)
    seed: int = 0  # data order, sampling, the buffer's random order
    trainer_procs: int = 1  # the trainer's ranks (dp_shard x tp, see trainer.parallel)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # optim, parallel, micro_batch_size, ...
    task: TaskConfig = field(default_factory=TaskConfig)  # prompts, columns, held-out split (forge_rl/data/task.py)
    rewards: list[RewardConfig] = field(
        default_factory=lambda: [RewardConfig("exact_match", 1.0), RewardConfig("format", 0.1)]
    )
    eval_every: int = 10  # steps between greedy held-out evaluations; 0 = only at the start (GRPO) and the end
    eval_size: int = 500  # held-out prompts per evaluation (the first of the task's held-out set); 0 = none
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only at the end
    # true: continue the output_dir's run from its newest intact checkpoint (damaged ones are passed over, named);
    # auto: the same when it has one, else start afresh. A run already at `steps` has nothing to do (exit 0)
    resume: bool | str = False
    # a run owns output_dir (its id in output_dir/run.json): a new run there, or where trainer.checkpoint_dir holds
    # checkpoints, is refused unless resumed or overwrite=true, which first removes the earlier run's files
    overwrite: bool = False
    output_dir: str = "outputs/run"
    export_dir: str | None = (
        "${output_dir}/hf"  # the final policy as an HF model directory (vLLM, transformers); null = none
    )
    launcher: LauncherConfig = field(default_factory=LauncherConfig)  # local, or a Slurm allocation (docs/slurm.md)
    # false: the role processes' output (vLLM, TorchTitan, Monarch) goes to output_dir/logs/<role>.log and the
    # console shows the run's progress; true (or --verbose): everything on the console
    verbose: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "trainer_procs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "eval_size", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"resume={self.resume!r}: use true, false or auto")


def dp_size(cfg: RunConfig, batch_key: str) -> int:
    """The trainer's data-parallel size: trainer_procs over trainer.parallel's tp (or its dp_shard), which must
    fill trainer_procs exactly and divide the run's batch (`batch_key`: batch_groups, batch_size), since every
    data-parallel rank takes an equal share."""
    p, procs = cfg.trainer.parallel, cfg.trainer_procs
    if p.tp < 1 or procs % p.tp:
        raise ConfigError(f"trainer_procs={procs} is not a multiple of trainer.parallel.tp={p.tp}")
    dp = procs // p.tp if p.dp_shard == -1 else p.dp_shard
    if dp < 1 or dp * p.tp != procs:
        raise ConfigError(f"trainer.parallel dp_shard={p.dp_shard} x tp={p.tp} does not fit trainer_procs={procs}")
    batch = getattr(cfg, batch_key)
    if batch % dp:
        raise ConfigError(f"{batch_key}={batch} must be a multiple of the data-parallel size {dp}")
    return dp
