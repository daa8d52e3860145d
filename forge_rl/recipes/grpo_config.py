"""The GRPO run's config and its start-up checks: what the run reads, and the settings that only make sense
together (errors name the keys). The run itself is forge_rl/recipes/grpo.py."""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_rl.actors.generator import SWAP_MODES
from forge_rl.actors.generator_engine import route_engine_args
from forge_rl.actors.reward import RewardSpec, check_reward_columns, reward_model_errors
from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.config import ConfigError
from forge_rl.deps.vllm import check_engine_args
from forge_rl.launch.launcher import LauncherConfig
from forge_rl.data.task import TaskConfig, TaskRows, check_prompts_fit, first_prompts
from forge_rl.errors import UserError
from forge_rl.envs import EnvConfig, env_factory
from forge_rl.runtime.placement import ResourcesConfig
from forge_rl.runtime.provisioner import visible_gpus
from forge_rl.runtime.timeouts import TimeoutsConfig
from forge_rl.rewards.overlong import OverlongConfig
from forge_rl.loop.lengths import ResponseLengths
from forge_rl.loop.sampling import behaviour_temperature, truncation
from forge_rl.models import model_path
from forge_rl.weights import WeightStoreConfig


STALE_IN_FLIGHT = ("finish", "requeue")


@dataclass
class GeneratorSection:
    replicas: int = 1
    swap_mode: str = "recompute_kv"  # keep_kv | recompute_kv | drain
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM AsyncEngineArgs
    log_level: str = "WARNING"  # vLLM's console output; INFO shows its per-update lines
    # vLLM SamplingParams: the behaviour policy. The trainer reads its temperature from here; options it
    # cannot reproduce (penalties, logit biases, ...: forge_rl/loop/sampling.py) are refused at start. Truncation
    # (top_p, top_k, min_p) is reproduced: each token's kept set is recorded and the trainer renormalises over it
    sampling: dict[str, Any] = field(default_factory=lambda: dict(temperature=1.0, max_tokens=8))
    # truncated sampling: the most ids of one token's kept set that are recorded (4 bytes each); a sample with a
    # larger set is not trained on (drops/sampling_mask_over_cap). docs/algorithms.md, "Keep Sampling Mask"
    max_kept_tokens: int = 64
    # drawn, long-tailed response lengths (a workload, e.g. reasoning models' tails): forge_rl/loop/lengths.py
    lengths: ResponseLengths = field(default_factory=ResponseLengths)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"generator.replicas must be >= 1, got {self.replicas}")
        cap = self.max_kept_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"generator.max_kept_tokens={self.max_kept_tokens!r}: give an integer >= 1")
        if self.swap_mode not in SWAP_MODES:
            raise ValueError(f"generator.swap_mode={self.swap_mode!r}; choose one of {SWAP_MODES}")


@dataclass
class BufferSection:
    """The replay buffer's own settings; max_policy_age, the data-parallel size and padding come from
    the run (top-level `max_policy_age`, trainer.parallel, the tokenizer)."""

    capacity: int = 64  # groups
    order: str = "oldest"  # "oldest" | "random"
    max_resample: int = 1  # times a group may be trained on
    min_fresh_groups: int = 1
    drop_zero_advantage: bool = True

    def __post_init__(self) -> None:
        if self.order not in ("oldest", "random"):
            raise ValueError(f"buffer.order={self.order!r}; choose 'oldest' or 'random'")
        for name in ("capacity", "max_resample"):
            if getattr(self, name) < 1:
                raise ValueError(f"buffer.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_fresh_groups < 0:
            raise ValueError(f"buffer.min_fresh_groups must be >= 0, got {self.min_fresh_groups}")


@dataclass
class ReferenceSection:
    """The reference policy (KL penalty) or teacher (distillation): frozen, or following the policy."""

    # every this many steps the reference loads the policy's version step - follow_lag from the weight store (a KL
    # to a moving anchor, self-distillation); 0: frozen, the model it was built from
    follow_every: int = 0
    follow_lag: int = 1  # versions behind the policy; the weight store must still hold it (weight_store.keep_versions)


@dataclass
class GRPOConfig:
    model: str = "tiny-warm"
    steps: int = 100
    group_size: int = 8  # completions per prompt (G)
    batch_groups: int = 16  # groups per train step
    rollout_tasks: int = 4  # concurrent rollouts at most (admission may allow fewer)
    async_mode: bool = True  # false (+ max_policy_age 0): the synchronous baseline
    max_policy_age: int = 1  # a token made by version u is trained on at version v only if v - u <= this
    # a sequence still generating when no batch could train its oldest token any more: "finish" it under the newer
    # weights (the buffer drops its group as stale), or "requeue" (abort it, generate its prompt again)
    stale_in_flight: str = "finish"
    trainer_procs: int = 1
    scale_advantages_by_std: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    task: TaskConfig = field(default_factory=TaskConfig)  # prompts, columns, held-out split (forge_rl/data/task.py)
    rewards: list[RewardSpec] = field(
        default_factory=lambda: [RewardSpec("exact_match", 1.0), RewardSpec("format", 0.1)]
    )
    reward_timeout_s: float | None = 60.0  # per reward function call; a slower group is dropped and counted
    reward_workers: int | None = None  # processes that run reward functions (null: 2 to 4, by the cores)
    reward_memory_mb: int | None = 8192  # address space per reward worker; past it the group is dropped, counted
    # Multi-turn: an environment answers each model turn (feedback, tool results) until done; it rewards the
    # trajectory, and its tokens are masked out of the loss (forge_rl/envs, forge_rl/loop/multiturn.py)
    env: EnvConfig = field(default_factory=EnvConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # DAPO: length penalty, truncation filter
    generator: GeneratorSection = field(default_factory=GeneratorSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer: BufferSection = field(default_factory=BufferSection)
    reference: ReferenceSection = field(default_factory=ReferenceSection)
    weight_store: WeightStoreConfig = field(default_factory=WeightStoreConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)  # placement, cores, threads
    launcher: LauncherConfig = field(default_factory=LauncherConfig)  # local, or a Slurm allocation (docs/slurm.md)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)  # hung ranks and loads stop the run, named
    eval_every: int = 10  # steps; 0 = only before and after
    eval_size: int = 500  # held-out prompts (the first of the task's held-out set), greedy
    checkpoint_every: int = 0  # steps; 0 = only at the end
    checkpoint_keep_last: int = 3  # complete checkpoints kept (older ones removed); 0 = all
    export_dir: str | None = "${output_dir}/hf"  # the final policy as an HF model directory (vLLM, transformers); null = none
    no_batch_timeout_s: float = 300.0  # stop, saying why, when no batch could be sampled for this long
    # true: continue the output_dir's run from its newest intact checkpoint (damaged ones are passed over, named);
    # auto: the same when it has one, else start afresh. A run already at `steps` has nothing to do (exit 0)
    resume: bool | str = False
    # a run owns output_dir (its id in output_dir/run.json): a new run there, or where trainer.checkpoint_dir holds
    # checkpoints, is refused unless resumed or overwrite=true, which first removes the earlier run's files
    overwrite: bool = False
    output_dir: str = "outputs/grpo"
    # false: the role processes' output (vLLM, TorchTitan, Monarch) goes to output_dir/logs/<role>.log and the
    # console shows the run's progress; true (or --verbose): everything on the console
    verbose: bool = False
    wandb_project: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "batch_groups", "rollout_tasks", "trainer_procs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_policy_age", "eval_every", "eval_size", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("reward_timeout_s", "reward_workers", "reward_memory_mb"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (or null), got {getattr(self, name)}")
        if self.checkpoint_keep_last < 0:
            raise ValueError(f"checkpoint_keep_last must be >= 0 (0 keeps all), got {self.checkpoint_keep_last}")
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"resume={self.resume!r}: use true, false or auto")
        if self.no_batch_timeout_s <= 0:
            raise ValueError(f"no_batch_timeout_s must be > 0, got {self.no_batch_timeout_s}")
        if self.stale_in_flight not in STALE_IN_FLIGHT:
            raise ValueError(f"stale_in_flight={self.stale_in_flight!r}; choose one of {STALE_IN_FLIGHT}")


def check_config(cfg: GRPOConfig) -> None:
    """Settings that only make sense together; errors name the keys."""
    check_sampling(cfg)
    check_engine_args(cfg.generator.engine_args, "generator.engine_args")  # before an engine start finds it
    cfg.trainer.collective_timeout_s = cfg.timeouts.collective_s  # the trainer's process group
    if cfg.trainer.publish_dtype is None and cfg.generator.engine_args.get("dtype") in ("float32", "bfloat16"):
        cfg.trainer.publish_dtype = cfg.generator.engine_args["dtype"]  # push weights as the engine holds them
    logprobs_mode = cfg.generator.engine_args.get("logprobs_mode", "processed_logprobs")
    if logprobs_mode != "processed_logprobs":
        raise ConfigError(f"generator.engine_args.logprobs_mode={logprobs_mode!r}: behaviour logprobs must be of the "
                          "sampled distribution (after temperature); use 'processed_logprobs'")
    if cfg.trainer.grpo.normalize == "token_sum" and not cfg.trainer.grpo.max_response_len:
        cfg.trainer.grpo.max_response_len = response_budget(cfg)  # Dr. GRPO's constant: the generation budget
    check_reference(cfg)
    if cfg.trainer.profile_steps and max(cfg.trainer.profile_steps) > cfg.steps:  # a window would never end
        raise ConfigError(f"trainer.profile_steps={list(cfg.trainer.profile_steps)} goes past the run's last step "
                          f"(steps={cfg.steps}); profile steps 1 to {cfg.steps}")
    if cfg.buffer.capacity < cfg.batch_groups:
        raise ConfigError(f"buffer.capacity={cfg.buffer.capacity} is smaller than batch_groups={cfg.batch_groups}")
    overlong = cfg.overlong.filter or cfg.overlong.penalty_cache_len
    if overlong and cfg.env.name is not None:
        raise ConfigError("overlong.* applies to single-turn rollouts; with env.name set, limit trajectories with "
                          "env.max_total_tokens")
    if cfg.overlong.penalty_cache_len >= cfg.generator.sampling.get("max_tokens", 16):
        raise ConfigError(f"overlong.penalty_cache_len={cfg.overlong.penalty_cache_len} must be smaller than "
                          f"generator.sampling.max_tokens={cfg.generator.sampling.get('max_tokens', 16)}")
    check_single_turn_options(cfg)
    if cfg.env.name is not None:
        try:
            env_cls = env_factory(cfg.env)  # an unknown name or arguments fail here, naming env.name / env.args
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # what the environment needs the chat template to show the model (e.g. its tools)
        cfg.chat_template_kwargs = {**env_cls.template_kwargs, **cfg.chat_template_kwargs}
    if cfg.launcher.kind == "slurm":
        check_slurm_sizes(cfg)
    for i, spec in enumerate(cfg.rewards):
        if spec.model is not None:  # a reward model's checkpoint must be there before any actor starts
            model_path(spec.model, f"rewards[{i}].model")
            check_engine_args(spec.engine_args, f"rewards[{i}].engine_args")
            if errors := reward_model_errors(spec):
                raise ConfigError("; ".join(f"rewards[{i}].{error}" for error in errors))
    names = [r.name for r in cfg.rewards]
    if cfg.task.eval_reward is not None and cfg.task.eval_reward not in names:
        raise ConfigError(f"task.eval_reward={cfg.task.eval_reward!r} is not one of the rewards {names}")


def check_single_turn_options(cfg: GRPOConfig) -> None:
    """generator.lengths and stale_in_flight "requeue" act on single-turn rollouts (one request per group)."""
    lengths = cfg.generator.lengths
    lengths.check(cfg.generator.sampling.get("max_tokens", 16))
    if lengths.enabled and (cfg.overlong.filter or cfg.overlong.penalty_cache_len):
        raise ConfigError("generator.lengths draws every response's length (its tokens after the end are filler): "
                          "overlong.* would judge the drawn lengths; turn one of them off")
    for name, on in (("generator.lengths", lengths.enabled), ("stale_in_flight=requeue", cfg.stale_in_flight == "requeue")):
        if on and cfg.env.name is not None:
            raise ConfigError(f"{name} applies to single-turn rollouts; env.name={cfg.env.name!r} is multi-turn")


def check_sampling(cfg: GRPOConfig) -> None:
    """The behaviour policy (generator.sampling): options the trainer reproduces, a temperature > 0 that the trainer
    takes, and room for at least one response token."""
    temperature = behaviour_temperature(cfg.generator.sampling, max_kept_tokens=cfg.generator.max_kept_tokens)
    max_logprobs, cap = cfg.generator.engine_args.get("max_logprobs"), cfg.generator.max_kept_tokens
    if truncation(cfg.generator.sampling) and max_logprobs not in (None, -1) and max_logprobs <= cap:
        raise ConfigError(f"generator.engine_args.max_logprobs={max_logprobs}: truncated sampling reads each token's "
                          f"kept set from generator.max_kept_tokens + 1 = {cap + 1} logprobs; remove it (the "
                          "generator sets it) or lower generator.max_kept_tokens")
    if cfg.trainer.temperature is not None and cfg.trainer.temperature != temperature:
        raise ConfigError(
            f"trainer.temperature={cfg.trainer.temperature} differs from generator.sampling.temperature="
            f"{temperature}: the trainer must reproduce the sampling policy; set only generator.sampling.temperature"
        )
    cfg.trainer.temperature = temperature
    max_tokens = cfg.generator.sampling.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"generator.sampling.max_tokens={max_tokens!r}: a response needs at least one token; "
                          "give an integer >= 1")


def check_group_size(cfg: GRPOConfig, algorithm: str) -> None:
    """For an advantage relative to the group (each reward minus its group's mean): one sample per prompt has
    advantage 0 always, and nothing would be learned (the buffer drops every such group)."""
    if cfg.group_size >= 2:
        return
    if cfg.trainer.grpo.distill_coef > 0:
        raise ConfigError(f"group_size={cfg.group_size}: the reward's part of distillation's advantage "
                          f"(trainer.grpo.reward_coef={cfg.trainer.grpo.reward_coef}) is relative to the group, so 0 "
                          "with one sample per prompt; set group_size >= 2, or trainer.grpo.reward_coef=0 to learn "
                          "from the teacher alone")
    raise ConfigError(f"group_size={cfg.group_size}: {algorithm}'s advantage is each reward minus its group's mean, "
                      "0 with one sample per prompt, so nothing would be learned; set group_size >= 2 (e.g. 8), or "
                      "use PPO (python -m apps.ppo.main), whose critic needs no group")


def check_slurm_sizes(cfg: GRPOConfig) -> None:
    """Ranks and replicas must fit the nodes asked for: an allocation that cannot hold them fails after the queue."""
    s = cfg.launcher.slurm
    if cfg.trainer_procs % s.trainer_nodes:
        raise ConfigError(f"trainer_procs={cfg.trainer_procs} must spread evenly over launcher.slurm.trainer_nodes="
                          f"{s.trainer_nodes}")
    if s.gpus_per_node:
        per_node = cfg.trainer_procs // s.trainer_nodes
        tp = int(cfg.generator.engine_args.get("tensor_parallel_size", 1))
        replicas_per_node = math.ceil(cfg.generator.replicas / s.generator_nodes)
        if per_node > s.gpus_per_node:
            raise ConfigError(f"trainer_procs={cfg.trainer_procs} over launcher.slurm.trainer_nodes={s.trainer_nodes} "
                              f"is {per_node} ranks per node; launcher.slurm.gpus_per_node={s.gpus_per_node}")
        if replicas_per_node * tp > s.gpus_per_node:
            raise ConfigError(f"generator.replicas={cfg.generator.replicas} x tensor_parallel_size={tp} on "
                              f"launcher.slurm.generator_nodes={s.generator_nodes} needs {replicas_per_node * tp} GPUs "
                              f"per node; launcher.slurm.gpus_per_node={s.gpus_per_node}")


def check_task(cfg: GRPOConfig) -> TaskRows:
    """Read the task's data, its held-out set included, and match it to the rewards before any actor starts: a bad
    row or a missing column fails in seconds, naming the file, the row and the column. Returns the rows."""
    try:
        rows = TaskRows(cfg.task, cfg.seed)
        if cfg.eval_size:
            rows.held_out()
        if cfg.env.name is None:  # an environment scores trajectories itself
            check_reward_columns(cfg.rewards, rows.columns())
    except UserError:
        raise
    except ValueError as e:  # a reward that cannot be imported or does not fit the columns
        raise ConfigError(str(e)) from None
    return rows


def check_prompt_lengths(cfg: GRPOConfig, rows: TaskRows, tokenizer, model_dir: str) -> None:
    """Prompts too long for the engine are skipped one by one (and counted); a task where none fits is an error
    here, not an endless skip later, nor an evaluation of nothing."""
    model_len, room = model_len_and_room(cfg, model_dir)
    budget = "env.max_total_tokens" if cfg.env.name is not None else "generator.sampling.max_tokens"
    why = (f"the engine's max_model_len {model_len} minus {budget}={response_budget(cfg)}: raise "
           "generator.engine_args.max_model_len or shorten the prompts")
    task, kwargs = rows.cfg, cfg.chat_template_kwargs
    check_prompts_fit(f"task.source {task.source!r}", first_prompts(rows), tokenizer, task, room, why, **kwargs)
    if cfg.eval_size:
        check_prompts_fit(f"task.held_out {task.held_out!r}", rows.held_out()[:cfg.eval_size], tokenizer, task, room,
                          why, **kwargs)


def check_moe(cfg: GRPOConfig, model_dir: str) -> None:
    """A mixture-of-experts model (HF model_type qwen3_moe) and the trainer settings that depend on it, before any
    actor starts: no tensor parallelism over the experts, no LoRA (adapters on the grouped experts are not built),
    expert parallelism, Keep Routing and the load-balancing loss only on MoE, and over a divisor of the experts."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    moe = hf.get("model_type") == "qwen3_moe"
    ep = cfg.trainer.parallel.ep
    if moe and cfg.trainer.parallel.tp > 1:
        raise ConfigError(f"trainer.parallel.tp={cfg.trainer.parallel.tp}: tensor parallelism is not supported on a "
                          f"mixture-of-experts model ({cfg.model}): forge_rl loads, computes and publishes the experts "
                          "whole or split by expert only; set trainer.parallel.tp=1 and split them with "
                          "trainer.parallel.ep")
    if moe and cfg.trainer.lora.enabled:
        raise ConfigError(f"trainer.lora.rank={cfg.trainer.lora.rank}: LoRA is not supported on a mixture-of-experts "
                          f"model ({cfg.model} is {hf.get('architectures', ['Qwen3-MoE'])[0]}); set trainer.lora.rank=0 "
                          "(full fine-tuning, with trainer.parallel.ep for the experts)")
    if cfg.trainer.keep_routing and not moe:
        raise ConfigError(f"trainer.keep_routing=true: Keep Routing replays the experts the engine chose, and "
                          f"{cfg.model} is dense (model_type {hf.get('model_type')!r}); set trainer.keep_routing=false")
    if cfg.trainer.keep_routing:  # the engine arguments the generators will refuse, refused before they start
        on_gpu = bool(cfg.launcher.slurm.gpus_per_node) if cfg.launcher.kind == "slurm" else bool(visible_gpus())
        route_engine_args(on_gpu, cfg.generator.engine_args, "generator.engine_args")
    if cfg.trainer.moe_aux_loss_coef and not moe:
        raise ConfigError(f"trainer.moe_aux_loss_coef={cfg.trainer.moe_aux_loss_coef}: a load-balancing loss needs "
                          f"a mixture-of-experts model, and {cfg.model} is dense; set it to 0")
    if ep < 1:
        raise ConfigError(f"trainer.parallel.ep={ep}: give the expert-parallel degree, >= 1")
    if ep > 1 and not moe:
        raise ConfigError(f"trainer.parallel.ep={ep}: expert parallelism needs a mixture-of-experts model, and "
                          f"{cfg.model} is dense (model_type {hf.get('model_type')!r}); set trainer.parallel.ep=1")
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if ep > 1 and (experts % ep or cfg.trainer_procs % ep):
        raise ConfigError(f"trainer.parallel.ep={ep} must divide the model's {experts} experts and trainer_procs="
                          f"{cfg.trainer_procs}")


def dp_size(cfg: GRPOConfig) -> int:
    p = cfg.trainer.parallel
    dp = cfg.trainer_procs // p.tp if p.dp_shard == -1 else p.dp_shard
    if dp < 1 or cfg.batch_groups % dp:
        raise ConfigError(f"batch_groups={cfg.batch_groups} must be a multiple of the data-parallel size {dp}")
    return dp


def response_budget(cfg: GRPOConfig) -> int:
    """Response tokens a trajectory may hold: the sampling's max_tokens, or env.max_total_tokens (multi-turn)."""
    return int(cfg.env.max_total_tokens if cfg.env.name is not None else cfg.generator.sampling.get("max_tokens", 16))


def max_prompt_tokens(cfg: GRPOConfig, model_dir: str) -> int:
    """Prompt tokens that leave room for max_tokens in the engine's max_model_len (default: the model's)."""
    return model_len_and_room(cfg, model_dir)[1]


def model_len_and_room(cfg: GRPOConfig, model_dir: str) -> tuple[int, int]:
    """The engine's max_model_len (default: the model's) and the prompt tokens it leaves beside a response."""
    limit = cfg.generator.engine_args.get("max_model_len")
    if limit is None:
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
        limit = model_config["max_position_embeddings"]
    room = int(limit) - response_budget(cfg)
    if room < 1:
        raise ConfigError(f"generator.sampling.max_tokens={cfg.generator.sampling.get('max_tokens')} leaves no room "
                          f"for a prompt in max_model_len={limit} (generator.engine_args.max_model_len)")
    return int(limit), room


def check_reference(cfg: GRPOConfig) -> None:
    """reference.follow_every needs a reference, and a lag the weight store still holds after a publish."""
    r = cfg.reference
    if r.follow_every < 0 or r.follow_lag < 1:
        raise ConfigError(f"reference.follow_every={r.follow_every} must be >= 0 and reference.follow_lag="
                          f"{r.follow_lag} >= 1")
    if not r.follow_every:
        return
    if not (cfg.trainer.grpo.kl_coef or cfg.trainer.grpo.distill_coef):
        raise ConfigError(f"reference.follow_every={r.follow_every} but the run has no reference policy: set "
                          "trainer.grpo.kl_coef > 0 (a KL to a moving anchor), or use apps/distill")
    if r.follow_lag >= cfg.weight_store.keep_versions:
        raise ConfigError(f"reference.follow_lag={r.follow_lag}: the weight store keeps only the newest "
                          f"{cfg.weight_store.keep_versions} versions (weight_store.keep_versions); set it to at "
                          f"least {r.follow_lag + 1}")
