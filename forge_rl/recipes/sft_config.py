"""Supervised fine-tuning's config: what every run shares (RunConfig, under the same keys as GRPO's) and the
dataset, the batch and the evaluation engine. Torch-free, so that a config is read and checked in a moment; the run
is forge_rl/recipes/sft.py."""

from dataclasses import dataclass, field
from typing import ClassVar

from forge_rl.actors.trainer_config import OptimizerConfig, TrainerConfig
from forge_rl.recipes.grpo_config import GeneratorConfig
from forge_rl.recipes.run_config import RunConfig
from forge_rl.rewards.reward_config import RewardConfig


def _default_trainer() -> TrainerConfig:
    return TrainerConfig(objective="sft", optim=OptimizerConfig(lr=1e-3), checkpoint_dir="${output_dir}/checkpoints")


def _default_generator() -> GeneratorConfig:
    return GeneratorConfig(engine_args=dict(max_model_len=128), sampling=dict(max_tokens=8))


def eval_max_tokens(cfg: "SFTConfig") -> int:
    """The evaluation's generation budget (generator.sampling.max_tokens; greedy)."""
    return int(cfg.generator.sampling.get("max_tokens", 8))


@dataclass
class SFTConfig(RunConfig):
    RENAMED: ClassVar[dict[str, str]] = {
        "save_every": "checkpoint_every",
        "procs": "trainer_procs",
        "engine_args": "generator.engine_args",
        "eval_max_tokens": "generator.sampling.max_tokens",
    }

    model: str = "tiny"
    steps: int = 300
    trainer: TrainerConfig = field(default_factory=_default_trainer)
    # the evaluation: the task's held-out set (forge_rl/data/task.py), greedy, scored by `rewards` like GRPO's
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig("exact_match", 1.0)])
    eval_every: int = 0  # greedy held-out evaluation every N steps; 0 = only at the end
    output_dir: str = "outputs/sft"
    # "arithmetic" (generated in code), "task" (the `task:` below: its rows, their answers the targets, images
    # included), or a local .jsonl file / HF dataset directory
    dataset: str = "arithmetic"
    batch_size: int = 256  # sequences per step, over all data-parallel ranks
    # the evaluation's engine, under GRPO's keys: generator.engine_args (vLLM's) and generator.sampling.max_tokens
    generator: GeneratorConfig = field(default_factory=_default_generator)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if eval_max_tokens(self) < 1:
            raise ValueError(f"generator.sampling.max_tokens must be >= 1, got {eval_max_tokens(self)}")
