"""The GRPO run's config: what the run reads (PPO's and distillation's configs derive from it). Torch-free, so that
a config is read and checked in a moment; the start-up checks of settings that only make sense together are
forge_rl/recipes/grpo_checks.py. The run itself is forge_rl/recipes/rl_run.py."""

from dataclasses import dataclass, field
from typing import Any

from forge_rl.actors.generator_modes import SWAP_MODES
from forge_rl.agents.config import AgentConfig
from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
from forge_rl.envs.base import EnvConfig
from forge_rl.loop.lengths import ResponseLengthsConfig
from forge_rl.recipes.run_config import RunConfig
from forge_rl.rewards.overlong import OverlongConfig
from forge_rl.runtime.placement import ResourcesConfig
from forge_rl.runtime.timeouts import TimeoutsConfig
from forge_rl.weights.store_config import WeightStoreConfig


STALE_IN_FLIGHT = ("finish", "requeue")


@dataclass
class GeneratorConfig:
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
    lengths: ResponseLengthsConfig = field(default_factory=ResponseLengthsConfig)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"generator.replicas must be >= 1, got {self.replicas}")
        cap = self.max_kept_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"generator.max_kept_tokens={self.max_kept_tokens!r}: give an integer >= 1")
        if self.swap_mode not in SWAP_MODES:
            raise ValueError(f"generator.swap_mode={self.swap_mode!r}; choose one of {SWAP_MODES}")


@dataclass
class ReferenceConfig:
    """The reference policy (KL penalty) or teacher (distillation): frozen, or following the policy."""

    # every this many steps the reference loads the policy's version step - follow_lag from the weight store (a KL
    # to a moving anchor, self-distillation); 0: frozen, the model it was built from
    follow_every: int = 0
    follow_lag: int = 1  # versions behind the policy; the weight store must still hold it (weight_store.keep_versions)


@dataclass
class GRPOConfig(RunConfig):
    group_size: int = 8  # completions per prompt (G)
    batch_groups: int = 16  # groups per train step
    rollout_tasks: int = 4  # concurrent rollouts at most (admission may allow fewer)
    async_mode: bool = True  # false (+ max_policy_age 0): the synchronous baseline
    max_policy_age: int = 1  # a token made by version u is trained on at version v only if v - u <= this
    # a sequence still generating when no batch could train its oldest token any more: "finish" it under the newer
    # weights (the buffer drops its group as stale), or "requeue" (abort it, generate its prompt again)
    stale_in_flight: str = "finish"
    scale_advantages_by_std: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    reward_timeout_s: float | None = 60.0  # per reward function call; a slower group is dropped and counted
    reward_workers: int | None = None  # processes that run reward functions (null: 2 to 4, by the cores)
    reward_memory_mb: int | None = 8192  # address space per reward worker; past it the group is dropped, counted
    # Multi-turn: an environment answers each model turn (feedback, tool results) until done; it rewards the
    # trajectory, and its tokens are masked out of the loss (forge_rl/envs, forge_rl/loop/multiturn.py)
    env: EnvConfig = field(default_factory=EnvConfig)
    # An agent written against the openai client (agent.entry): the run serves an OpenAI-compatible endpoint backed
    # by its generators, and trains on the exact tokens of the agent's calls (forge_rl/agents, docs/agents.md)
    agent: AgentConfig = field(default_factory=AgentConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # DAPO: length penalty, truncation filter
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    weight_store: WeightStoreConfig = field(default_factory=WeightStoreConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)  # placement, cores, threads
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)  # hung ranks and loads stop the run, named
    checkpoint_keep_last: int = 3  # complete checkpoints kept (older ones removed); 0 = all
    no_batch_timeout_s: float = 300.0  # stop, saying why, when no batch could be sampled for this long
    wandb_project: str | None = None
    output_dir: str = "outputs/grpo"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("group_size", "batch_groups", "rollout_tasks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_policy_age < 0:
            raise ValueError(f"max_policy_age must be >= 0, got {self.max_policy_age}")
        for name in ("reward_timeout_s", "reward_workers", "reward_memory_mb"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (or null), got {getattr(self, name)}")
        if self.checkpoint_keep_last < 0:
            raise ValueError(f"checkpoint_keep_last must be >= 0 (0 keeps all), got {self.checkpoint_keep_last}")
        if self.no_batch_timeout_s <= 0:
            raise ValueError(f"no_batch_timeout_s must be > 0, got {self.no_batch_timeout_s}")
        if self.stale_in_flight not in STALE_IN_FLIGHT:
            raise ValueError(f"stale_in_flight={self.stale_in_flight!r}; choose one of {STALE_IN_FLIGHT}")
