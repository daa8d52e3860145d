"""Supervised fine-tuning's config: what every run shares (RunConfig, under the same keys as GRPO's) and the
dataset, the batch and the evaluation engine. Torch-free, so that a config is read and checked in a moment; the run
is forge_rl/recipes/sft.py."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from forge_rl.actors.trainer_config import OptimizerConfig, TrainerConfig
from forge_rl.recipes.run_config import RunConfig
from forge_rl.rewards.reward_config import RewardConfig


def _default_trainer() -> TrainerConfig:
    return TrainerConfig(loss="sft", optim=OptimizerConfig(lr=1e-3), checkpoint_dir="${output_dir}/checkpoints")


@dataclass
class SFTConfig(RunConfig):
    RENAMED: ClassVar[dict[str, str]] = {"save_every": "checkpoint_every", "procs": "trainer_procs"}

    model: str = "tiny"
    steps: int = 300
    trainer: TrainerConfig = field(default_factory=_default_trainer)
    # the evaluation: the task's held-out set (forge_rl/data/task.py), greedy, scored by `rewards` like GRPO's
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig("exact_match", 1.0)])
    eval_every: int = 0  # greedy held-out evaluation every N steps; 0 = only at the end
    output_dir: str = "outputs/sft"
    dataset: str = "arithmetic"  # "arithmetic" (generated in code) or a local .jsonl file / HF dataset directory
    batch_size: int = 256  # sequences per step, over all data-parallel ranks
    eval_max_tokens: int = 8
    engine_args: dict[str, Any] = field(default_factory=lambda: dict(max_model_len=128))  # vLLM, for evaluation

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("batch_size", "eval_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
