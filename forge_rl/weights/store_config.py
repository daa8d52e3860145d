"""The weight store's settings (`weight_store:` in a run's config), apart from the store so that a config is read
without torch."""

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightStoreConfig:
    keep_versions: int = 2  # newest K versions kept per host; older ones are freed
    root: str | None = None  # this host's version directory; default /dev/shm/forge_rl-<run>-weights-<host>
    bucket_mb: int = 64  # size of one RDMA read across hosts (64 MB suits the TCP fallback)
    host_id: str | None = None  # who counts as "this host"; default $FORGE_RL_HOST_ID or the hostname

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ValueError(f"WeightStoreConfig.keep_versions must be >= 1, got {self.keep_versions}")
        if self.bucket_mb < 1:
            raise ValueError(f"WeightStoreConfig.bucket_mb must be >= 1, got {self.bucket_mb}")
