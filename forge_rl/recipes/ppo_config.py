"""PPO's config: GRPO's with a critic (`critic:`) and GAE's settings (`gae:`). Torch-free, so that a config is read
and checked in a moment; the run is forge_rl/recipes/ppo.py."""

from dataclasses import dataclass, field
from typing import ClassVar

from forge_rl.actors.trainer_config import OptimizerConfig
from forge_rl.recipes.grpo_config import GRPOConfig


@dataclass
class CriticConfig:
    """The critic (`critic:`): a value model trained beside the policy on the batch's returns."""

    model: str | None = None  # the body's checkpoint; null: the policy's (model). The value head starts at 0
    value_clip: float = 0.2  # |V - V_old| beyond this is clipped in the value loss (PPO); 0: no clip
    epochs: int = 1  # critic optimizer steps per train step on its batch (the clip acts from the second)
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4))


@dataclass
class GAEConfig:
    """Generalized advantage estimation over the model tokens (`gae:`), from the critic's values."""

    gamma: float = 1.0  # discount per model token
    lam: float = 0.95  # GAE's lambda: 1 is the Monte-Carlo return minus the value, 0 one-step TD
    whiten_advantages: bool = True  # (A - mean) / std over the step's model tokens

    def __post_init__(self) -> None:
        if not (0 < self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gae.gamma={self.gamma} must be in (0, 1] and gae.lam={self.lam} in [0, 1]")


@dataclass
class PPOConfig(GRPOConfig):
    RENAMED: ClassVar[dict[str, str]] = {"ppo": "gae"}

    group_size: int = 1  # PPO's baseline is the critic: one sample per prompt is enough
    critic: CriticConfig = field(default_factory=CriticConfig)
    gae: GAEConfig = field(default_factory=GAEConfig)
