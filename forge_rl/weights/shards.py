"""Where a writer rank's piece of a tensor goes in the full tensor.

A trainer rank holds DTensor shards (FSDP2 / TP). It copies its local shard straight into the full tensor's bytes
(in shared memory, or a file) at the shard's global offset, so readers get full tensors and nobody gathers. Every
placement a parameter has leaves each rank one box of the tensor: Shard, Replicate, and FSDP2's _StridedShard over
a TP Shard (FSDP over TP: the rank's rows of its TP block, one contiguous range; sharded_publish.check_tiling
asserts the boxes cover each tensor exactly once). Only a pending reduction (Partial) is not a box.
"""

import math

import torch


def box_of(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of the block of the whole tensor this rank holds: all of it for a plain tensor."""
    from torch.distributed.tensor import DTensor, Partial

    from forge_rl.deps.pytorch import local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tuple(tensor.shape), (0,) * tensor.dim()
    if any(isinstance(p, Partial) for p in tensor.placements):
        raise ValueError(
            f"a DTensor with a pending reduction ({tensor.placements}) is not a block of a tensor: "
            "redistribute it first"
        )
    shape, offset = local_shape_and_global_offset(tensor)
    local = tuple(tensor.to_local().shape)
    if local != tuple(shape):
        raise ValueError(
            f"DTensor local shard has shape {list(local)}, its placements {tensor.placements} say {list(shape)}"
        )
    return tuple(shape), tuple(offset)


def local_piece(tensor: torch.Tensor, offset: tuple[int, ...] | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local data, its offset in the full tensor) for a full tensor, a plain shard, or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        if offset is not None:
            raise ValueError("a DTensor carries its own offset; do not pass one")
        return tensor.to_local(), box_of(tensor)[1]
    return tensor, tuple(offset) if offset is not None else (0,) * tensor.dim()


def region(full: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The view of `full` that a piece of `shape` at `offset` covers."""
    if len(offset) != full.dim() or len(shape) != full.dim():
        raise ValueError(f"piece of rank {len(shape)} at offset {list(offset)} for a tensor of rank {full.dim()}")
    for d, (o, s, n) in enumerate(zip(offset, shape, full.shape)):
        if o < 0 or o + s > n:
            raise ValueError(f"piece {list(shape)} at offset {list(offset)} exceeds dim {d} of {list(full.shape)}")
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def row_blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of a tensor of `shape`, each at most `block_bytes` (one row at least): moving a big
    tensor's shard a block at a time keeps what a rank holds beyond its state to one block."""
    rows, row_bytes = shape[0], math.prod(shape[1:]) * itemsize
    per_block = max(1, block_bytes // max(1, row_bytes))
    return [(r0, min(rows, r0 + per_block)) for r0 in range(0, rows, per_block)]
