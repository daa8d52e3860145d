"""The weight store interface: versioned, HF-named model weights from trainer ranks to generators.

A backend (shared memory + Monarch RDMA here, a torchstore release later) implements `WeightStore`.
Writers publish version `v` whole (`publish`) or shard by shard from several ranks (`writer`);
readers `prefetch(v)` into memory local to their host while they keep working, then `load(v)`
or hand `path(v)` (a safetensors checkpoint directory) to vLLM's `reload_weights`.

Guarantees every backend keeps:
- a version is visible all at once or not at all; a reader never sees a mix of versions;
- only the newest `keep_versions` versions are kept; asking for another one raises
  `VersionUnavailable`, which names the version asked for and the versions available;
- a reader that states the tensors it expects gets `WeightMismatch` naming the first tensor
  whose dtype or shape differs.
"""

import errno
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import torch

# {HF name: (dtype, shape)}: enough to lay out a version before any tensor is written.
TensorSpec = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


class VersionUnavailable(LookupError):
    """A version that was dropped, never published, or not published in time."""

    def __init__(self, version: int, available: list[int], why: str):
        self.version, self.available, self.why = version, available, why
        super().__init__(f"weights version {version} {why}; versions available: {available or 'none'}")

    def __reduce__(self):  # it crosses actor boundaries inside ActorError, so it must unpickle
        return type(self), (self.version, self.available, self.why)


class WeightStoreFull(OSError):
    """The store's filesystem had no room for a new version (ENOSPC when its pages were reserved).
    Nothing of that version was kept; the versions published before it are untouched."""

    def __init__(self, root: str, version: int, needed: int, free: int, keep_versions: int):
        self.root, self.version, self.needed, self.free, self.keep_versions = root, version, needed, free, keep_versions
        super().__init__(
            errno.ENOSPC,
            f"weight store {root} is full: weights version {version} needs {_size(needed)}, {_size(free)} free "
            f"(version {version} was not published; earlier versions are intact). Free space on that filesystem "
            f"(`df -h {root}`; /dev/shm is shared by the whole host), lower weight_store.keep_versions (now "
            f"{keep_versions}: a host holds up to that many versions), or set weight_store.root to a directory on "
            "a larger tmpfs",
        )

    def __reduce__(self):  # crosses actor boundaries inside ActorError
        return type(self), (self.root, self.version, self.needed, self.free, self.keep_versions)


def _size(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


class WeightMismatch(ValueError):
    """A stored tensor differs from what the reader expects (name, dtype or shape)."""


def spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The spec of a state dict (DTensors report their global shape)."""
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def check_spec(stored: TensorSpec, expected: TensorSpec, version: int) -> None:
    """Raise `WeightMismatch` naming the first tensor that differs between `stored` and `expected`."""
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise WeightMismatch(f"weights version {version} has no tensor {missing[0]!r} ({len(missing)} missing)")
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        raise WeightMismatch(f"weights version {version} has unexpected tensor {unexpected[0]!r}")
    for name, (dtype, shape) in expected.items():
        got_dtype, got_shape = stored[name]
        if (got_dtype, tuple(got_shape)) != (dtype, tuple(shape)):
            raise WeightMismatch(
                f"weights version {version}, tensor {name!r}: stored {got_dtype} {list(got_shape)}, "
                f"reader expects {dtype} {list(shape)}"
            )


class VersionWriter(ABC):
    """One writer rank's handle on a version being written. `commit()` when all its tensors are in;
    the version becomes visible once every rank committed. Leaving a `with` block through an
    exception aborts the version (nothing of it stays behind)."""

    @abstractmethod
    def write(self, name: str, tensor: torch.Tensor, offset: tuple[int, ...] | None = None) -> None:
        """Write a full tensor, a DTensor's local shard, or a plain shard whose place in the full
        tensor starts at `offset`."""

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...

    def __enter__(self) -> "VersionWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class WeightStore(ABC):
    """What a weight-store backend offers trainers (writers) and generators (readers)."""

    # --- writers
    @abstractmethod
    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Publish full tensors from one writer."""

    @abstractmethod
    def writer(self, version: int, spec: TensorSpec, rank: int = 0, world_size: int = 1) -> VersionWriter:
        """Start writing this rank's part of `version` (all ranks pass the same spec)."""

    # --- readers
    @abstractmethod
    def versions(self) -> list[int]:
        """Versions readable on this host, oldest first."""

    @abstractmethod
    def wait(self, version: int, timeout: float = 60.0) -> Path:
        """Block until `version` is readable on this host; return its checkpoint directory."""

    @abstractmethod
    async def prefetch(self, version: int, timeout: float = 60.0) -> Path:
        """Bring `version` into this host's memory (without blocking the event loop); return its directory."""

    @abstractmethod
    def path(self, version: int) -> Path:
        """Directory of a readable version: HF-named *.safetensors, what vLLM's reload_weights loads."""

    @abstractmethod
    def load(self, version: int, expected: TensorSpec | None = None) -> dict[str, torch.Tensor]:
        """The tensors of a readable version (read-only views where the backend can)."""

    @abstractmethod
    def close(self) -> None:
        """Release what this process holds."""
