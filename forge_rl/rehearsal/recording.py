"""Where a rehearsed rank's bytes go instead of shared memory and disk: writers that record what was written.

- `RecordingStore` stands in for the trainer's weight store (`trainer.store`): its writers take `.write(name,
  tensor, offset)` as the shared-memory writer does (a DTensor's piece found by the same `local_piece`) and record
  each piece's box. `Coverage` then checks, over all ranks, that every element of every published tensor was
  written exactly once, and keeps the largest piece a writer was handed.
- `RecordingStorage` is a DCP storage writer and reader: save records each item's bytes, load hands back fake
  tensors of the saved shapes (and the saved bytes of non-tensor items), so DCP's planners run as written.
"""

import contextlib
import io
import math
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from forge_rl.weights.shards import local_piece
from forge_rl.weights.store import VersionWriter


class Coverage:
    """The boxes written to each tensor of a version, over all ranks."""

    def __init__(self):
        self.spec: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self.largest_piece = 0

    def expect(self, spec) -> None:
        for name, (dtype, shape) in spec.items():
            if self.spec.setdefault(name, (dtype, tuple(shape))) != (dtype, tuple(shape)):
                raise ValueError(f"ranks disagree on the spec of {name}: {self.spec[name]} and {(dtype, shape)}")

    def add(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...], nbytes: int) -> None:
        self.boxes.setdefault(name, []).append((tuple(offset), tuple(shape)))
        self.largest_piece = max(self.largest_piece, nbytes)

    def problems(self) -> list[str]:
        """Every tensor of the spec whose elements were not each written exactly once (empty: all were)."""
        out = []
        for name, (_, shape) in self.spec.items():
            boxes = [b for b in self.boxes.get(name, []) if math.prod(b[1]) > 0]
            written = sum(math.prod(s) for _, s in boxes)
            if written != math.prod(shape):
                out.append(f"{name}: {written} elements written of {math.prod(shape)}")
            elif overlap := _overlap(boxes):
                out.append(f"{name}: pieces {overlap} overlap")
        return out + [f"{name}: written but not in the spec" for name in self.boxes if name not in self.spec]


def _overlap(boxes) -> tuple | None:
    for i, (a_at, a_shape) in enumerate(boxes):
        for b_at, b_shape in boxes[i + 1 :]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(a_at, a_shape, b_at, b_shape)):
                return (a_at, a_shape), (b_at, b_shape)
    return None


class RecordingWriter(VersionWriter):
    def __init__(self, coverage: Coverage, spec, memory):
        coverage.expect(spec)
        self.coverage, self.spec, self.memory = coverage, spec, memory

    def write(self, name: str, tensor: torch.Tensor, offset: tuple[int, ...] | None = None) -> None:
        if name not in self.spec:
            raise KeyError(f"tensor {name!r} is not in the version's spec")
        if tensor.dtype != self.spec[name][0]:
            raise TypeError(f"{name}: written as {tensor.dtype}, the spec says {self.spec[name][0]}")
        piece, at = local_piece(tensor, offset)
        self.coverage.add(name, at, tuple(piece.shape), piece.nbytes)
        self.memory.host_read(piece.nbytes)

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


class RecordingStore:
    """`trainer.store` for a rehearsal: one Coverage per version written; every version read (a following
    reference's) is the directory `published`, the rehearsal's checkpoint, which has the publish layout."""

    def __init__(self, memory, published=None):
        self.memory = memory
        self.published = published
        self.versions: dict[int, Coverage] = {}

    async def prefetch(self, version: int, timeout: float | None = None) -> None:
        pass  # on this host already

    @contextlib.contextmanager
    def pinned(self, version: int):
        yield self.published

    def writer(self, version: int, spec, rank: int = 0, world_size: int = 1) -> RecordingWriter:
        return RecordingWriter(self.versions.setdefault(version, Coverage()), spec, self.memory)

    def close(self) -> None:
        pass


def recorded_save_file(coverage: Coverage, memory):
    """A stand-in for safetensors' `save_file(tensors, path, metadata)`: every tensor written whole."""

    def save_file(tensors, filename, metadata=None):
        spec = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        writer = RecordingWriter(coverage, spec, memory)
        for name, tensor in tensors.items():
            writer.write(name, tensor)

    return save_file


class RecordingStorage(StorageWriter, StorageReader):
    """A DCP storage writer and reader in one: what save writes is recorded (the bytes of non-tensor items kept),
    and load reads fake tensors of the saved shapes."""

    def __init__(self, memory):
        self.memory, self.metadata, self.saved_bytes = memory, None, {}
        self.written, self.checkpoint_id = 0, None

    def reset(self, checkpoint_id=None) -> None:
        self.checkpoint_id = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner) -> Future:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                self.saved_bytes[item.index.fqn] = data.getvalue()
                nbytes = len(self.saved_bytes[item.index.fqn])
            else:
                nbytes = data.nbytes
                self.memory.host_read(nbytes)
            self.written += nbytes
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        done = Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        self.metadata = metadata
        if self.checkpoint_id is not None:  # what a loader reads before the tensors (their names and shapes only)
            Path(self.checkpoint_id).mkdir(parents=True, exist_ok=True)
            (Path(self.checkpoint_id) / ".metadata").write_bytes(pickle.dumps(metadata))

    def storage_meta(self):
        return None

    def read_metadata(self):
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def read_data(self, plan, planner) -> Future:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self.saved_bytes[item.storage_index.fqn]))
                continue
            target = planner.resolve_tensor(item)
            with self.memory.fake:
                block = torch.empty(item.lengths, dtype=target.dtype)
            self.memory.count(block)
            self.memory.host_read(block.nbytes)
            target.copy_(block)
            planner.commit_tensor(item, target)
        done = Future()
        done.set_result(None)
        return done
