"""The replay buffer's settings (`buffer:` in a run's config), apart from the buffer actor so that a config is read
without torch or Monarch. What the run decides for the buffer (the staleness bound, the data-parallel size,
padding, the seed and the behaviour temperature) is not here: the run passes it to the buffer
(forge_rl/actors/replay_buffer.py, GroupStore and ReplayBuffer)."""

from dataclasses import dataclass

ORDERS = ("oldest", "random")


@dataclass
class ReplayBufferConfig:
    capacity: int = 64  # groups
    order: str = "oldest"  # "oldest" (oldest tokens first, then by prompt id) | "random"
    max_resample: int = 1  # times a group may be trained on
    min_fresh_groups: int = 1  # per batch, groups never trained on before (matters when max_resample > 1)
    drop_zero_advantage: bool = True  # groups whose advantages are all zero carry no signal

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"buffer.order={self.order!r}; choose 'oldest' or 'random'")
        for name in ("capacity", "max_resample"):
            if getattr(self, name) < 1:
                raise ValueError(f"buffer.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_fresh_groups < 0:
            raise ValueError(f"buffer.min_fresh_groups must be >= 0, got {self.min_fresh_groups}")
