"""Where a writer rank's piece of a tensor goes in the full tensor.

A trainer rank holds DTensor shards (FSDP2 / TP). On one host it can copy its local shard straight
into the full tensor's bytes in shared memory at the shard's global offset, so readers get full
tensors and nobody gathers. Placements that are not one box per rank (strided FSDP x TP shards,
pending reductions) fall back to `full_tensor()`, a collective every rank joins in the same order.
"""

import torch


def local_piece(tensor: torch.Tensor, offset: tuple[int, ...] | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local data, its offset in the full tensor) for a full tensor, a plain shard, or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        if offset is not None:
            raise ValueError("a DTensor carries its own offset; do not pass one")
        if not _is_box_sharded(tensor):
            return tensor.full_tensor(), (0,) * tensor.dim()
        from forge_rl.deps.pytorch import local_shape_and_global_offset

        shape, global_offset = local_shape_and_global_offset(tensor)
        local = tensor.to_local()
        if tuple(local.shape) != tuple(shape):
            raise ValueError(f"DTensor local shard has shape {list(local.shape)}, expected {list(shape)}")
        return local, tuple(global_offset)
    return tensor, tuple(offset) if offset is not None else (0,) * tensor.dim()


def region(full: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The view of `full` that a piece of `shape` at `offset` covers."""
    if len(offset) != full.dim() or len(shape) != full.dim():
        raise ValueError(f"piece of rank {len(shape)} at offset {list(offset)} for a tensor of rank {full.dim()}")
    for d, (o, s, n) in enumerate(zip(offset, shape, full.shape)):
        if o < 0 or o + s > n:
            raise ValueError(f"piece {list(shape)} at offset {list(offset)} exceeds dim {d} of {list(full.shape)}")
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def _is_box_sharded(tensor) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    # Shard (exactly, not its strided subclass) and Replicate leave each rank one box of the tensor.
    return all(type(p) in (Shard, Replicate) for p in tensor.placements)
