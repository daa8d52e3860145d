"""Where a writer rank's piece of a tensor goes in the full tensor.

A trainer rank holds DTensor shards (FSDP2 / TP). On one host it can copy its local shard straight
into the full tensor's bytes in shared memory at the shard's global offset, so readers get full
tensors and nobody gathers. Placements that are not one box per rank (strided FSDP x TP shards,
pending reductions) fall back to `full_tensor()`, a collective every rank joins in the same order.
"""

import math

import torch


def local_piece(tensor: torch.Tensor, offset: tuple[int, ...] | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local data, its offset in the full tensor) for a full tensor, a plain shard, or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        if offset is not None:
            raise ValueError("a DTensor carries its own offset; do not pass one")
        if not is_box_sharded(tensor):
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


def is_box_sharded(tensor) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    # Shard (exactly, not its strided subclass) and Replicate leave each rank one box of the tensor.
    return all(type(p) in (Shard, Replicate) for p in tensor.placements)


def row_blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of a tensor of `shape`, each at most `block_bytes` (one row at least): moving a big
    tensor's shard a block at a time keeps what a rank holds beyond its state to one block."""
    rows, row_bytes = shape[0], math.prod(shape[1:]) * itemsize
    per_block = max(1, block_bytes // max(1, row_bytes))
    return [(r0, min(rows, r0 + per_block)) for r0 in range(0, rows, per_block)]
