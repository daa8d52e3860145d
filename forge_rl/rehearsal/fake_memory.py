"""A rank's memory without the memory: tensors that have shapes and storages but no data, and a count of the bytes
they would take.

    memory = FakeMemory()
    with memory:                       # the rank's own code runs as written
        trainer.setup(); memory.phase(); trainer.step(batches)
    memory.peak_bytes, memory.largest   # per phase

Under `FakeMemory` every tensor the code makes out of nothing (torch.empty, zeros, a model's `to_empty`) is a fake
tensor (torch's FakeTensorMode), unless it is a few integers the code reads (at most 16 MiB: a device mesh's rank
table, the indices DTensor computes shard offsets from), and so is everything computed from one: the weights,
activations, gradients,
optimizer states, gathered parameters. Tensors computed only from real ones stay real: the batches and what the
code decides from their contents (validation, prompt packing, masks) run as they would. Where real data meets a
fake tensor in a way whose result's shape depends on the data (a boolean mask indexing a fake tensor), the mask is
turned into the indices it selects first, so the shape is the real one. A scalar read of a fake tensor (a loss's
`.item()`, the gradient norm) answers 0: a finite loss and norm, so the code takes its usual path.

Every storage is counted from its creation until Python frees it (weak references, as torch's MemTracker does):
`live_bytes` now, `peak_bytes` since the last `phase()`, and the largest storage made in the phase with where it
was made. Storages made inside a tensor subclass's own dispatch (a DTensor's redistribution buffers) are not seen,
only what it returns.
"""

import traceback
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from forge_rl.deps.pytorch import fake_tensor_mode, is_fake, untyped_storages

aten = torch.ops.aten


@dataclass
class Largest:
    """The largest storage made in a phase: its bytes, shape and dtype, and the forge_rl line that made it."""

    nbytes: int = 0
    shape: tuple[int, ...] = ()
    dtype: str = ""
    where: str = ""


def _caller() -> str:
    """The innermost forge_rl frame outside this package: the line of the rank's code that made a tensor."""
    for frame in reversed(traceback.extract_stack(limit=60)):
        if "forge_rl" in frame.filename and "rehearsal" not in frame.filename:
            return f"{frame.filename.split('forge_rl/')[-1]}:{frame.lineno} {frame.name}"
    return "(torch)"


class FakeMemory(TorchDispatchMode):
    def __init__(self, where_above: int = 1 << 20, real_below: int = 16 << 20):
        super().__init__()
        self.real_below = real_below  # integer tensors made out of nothing stay real up to this size
        self.fake = fake_tensor_mode(allow_non_fake_inputs=True)
        self._sizes = WeakIdKeyDictionary()  # storage -> bytes, while it lives
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest = Largest()
        self.host_block = 0  # the largest block that went through host memory in the phase (checkpoint reads, writes)
        self.where_above = where_above  # look up the making line only for storages above this (a stack walk is slow)

    # ---- phases -----------------------------------------------------------------------------------------------
    def phase(self) -> None:
        """Start a phase: its peak starts at what is live now, its largest tensor at nothing."""
        self.peak_bytes, self.largest, self.host_block = self.live_bytes, Largest(), 0

    def host_read(self, nbytes: int) -> None:
        """A block of `nbytes` went through host memory (read from a checkpoint, handed to a writer)."""
        self.host_block = max(self.host_block, nbytes)

    def count(self, tensor: torch.Tensor) -> None:
        """Count a tensor made outside the dispatch (a fake checkpoint read)."""
        self._track(tensor)

    # ---- the dispatch -----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if func is aten._local_scalar_dense.default and tensors and is_fake(tensors[0]):
            return False if tensors[0].dtype == torch.bool else 0
        if func is aten.index.Tensor and is_fake(args[0]):
            args = (args[0], _indices_of_real_masks(args[1]), *args[2:])
        if func in _LIKE and is_fake(args[0]) and self._small_indices(args[0], kwargs.get("dtype")):
            args = (torch.empty(args[0].shape, dtype=args[0].dtype, device=args[0].device), *args[1:])  # its shape
            tensors = [args[0]]
        if all(t.is_meta and not is_fake(t) for t in tensors):  # out of nothing, or of meta tensors (to_empty)
            out = self._made(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        tree_map_only(torch.Tensor, self._track, out)
        return out

    def _small_indices(self, like: torch.Tensor, dtype: torch.dtype | None) -> bool:
        """Would a tensor shaped like `like`, of `dtype` (its own if None), be a few integers the code reads?"""
        dtype = dtype or like.dtype
        return not (dtype.is_floating_point or dtype.is_complex) and like.numel() * dtype.itemsize <= self.real_below

    def _made(self, func, args, kwargs):
        """A tensor made out of nothing: fake, unless it holds a few integers the code reads (a device mesh's
        ranks, the indices DTensor computes a strided shard's offsets from, packing's positions) or is meta (a model
        built on the meta device stays meta). Floating-point ones are always fake: a real buffer that fake weights
        are written into would hold garbage that the code then computes with. Made from meta tensors (`to_empty`:
        the parameters), it is fake whatever its size."""
        with self.fake:
            out = func(*args, **kwargs)
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        from_meta = any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0])
        indices = all(not (t.is_floating_point() or t.is_complex()) for t in made)
        if any(t.device.type == "meta" for t in made) or (
            not from_meta and indices and sum(t.nbytes for t in made) <= self.real_below
        ):
            return func(*args, **kwargs)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":  # a model built on the meta device takes no memory
            return
        for storage in untyped_storages(tensor):
            if storage in self._sizes:
                continue
            self._count(storage, storage.nbytes())
            nbytes = storage.nbytes()
            if nbytes > self.largest.nbytes:
                local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's own piece
                self.largest = Largest(
                    nbytes,
                    tuple(local.shape),
                    str(tensor.dtype).replace("torch.", ""),
                    _caller() if nbytes >= self.where_above else "",
                )

    def _count(self, storage, nbytes: int) -> None:
        size = self._sizes[storage] = [nbytes]  # a cell: FSDP2 frees and refills storages by resizing them
        self._grew(nbytes)
        weakref.finalize(storage, self._grew, 0, size)  # when it dies: its size then, given back

    def _grew(self, nbytes: int, dying: list | None = None) -> None:
        self.live_bytes += nbytes - (dying[0] if dying else 0)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _resize(self, storage, size: int) -> None:
        """`UntypedStorage.resize_` (FSDP2 frees an unsharded parameter by resizing its storage to 0 and
        all-gathers into it after growing it back): not a dispatched op, so counted here."""
        self._real_resize(storage, size)
        cell = self._sizes.get(storage)
        if cell is None:
            if storage.device.type != "meta" and size > 0:
                self._count(storage, storage.nbytes())
            return
        self._grew(storage.nbytes() - cell[0])
        cell[0] = storage.nbytes()

    def __enter__(self):
        self._real_resize = torch.UntypedStorage.resize_
        memory = self
        torch.UntypedStorage.resize_ = lambda storage, size: memory._resize(storage, size)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._real_resize
        return super().__exit__(*exc)


# ops that take only their input's shape (and dtype, device): an integer or boolean one made from a fake tensor is
# made out of nothing, as torch.zeros(shape) would be (a routing map scattered from real expert choices stays real)
_LIKE = (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default)


def _indices_of_real_masks(indices: list) -> list:
    """A real boolean mask among the indices of a fake tensor, as the integer indices it selects (the same
    result, with a shape the fake tensor can know)."""
    out = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool and not is_fake(index):
            out.extend(index.nonzero(as_tuple=True))
        else:
            out.append(index)
    return out
