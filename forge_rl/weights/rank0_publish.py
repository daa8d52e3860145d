"""Publishing a sharded model from rank 0, for trainer ranks on several hosts (a rank cannot write another host's
shared memory).

Every rank sends rank 0 its box of each parameter (its FSDP/TP shard), a block of rows at a time and converted to
the publish dtype; rank 0 writes each block straight into the version's file at its place, a fused q/k/v block
split into its q, k and v rows. No rank ever holds a whole tensor, only one block of at most `block_bytes`:
gathering each parameter whole held it on every rank, and over gloo about 2.5 times (benchmarks/scale_memory.py).

    plan = rank0_publish.plan(model, world)                   # once: a collective, boxes of every rank
    spec = rank0_publish.spec(model, targets, dtype)
    held = rank0_publish.stream(model, plan, targets, writer, rank, dtype, device, block_bytes)   # every rank

`targets` maps each parameter to its HF names: {part: [names]}, part None for a plain tensor or wq / wk / wv for
TorchTitan's fused q/k/v (forge_rl/models/fused_qkv.py); a tied embedding also names lm_head.weight.
"""

import math
from dataclasses import dataclass

import torch

from forge_rl.models import fused_qkv
from forge_rl.weights.shards import row_blocks


@dataclass(frozen=True)
class Box:
    """A block of a parameter that one rank holds and sends: `src` is the lowest rank holding it."""

    src: int
    shape: tuple[int, ...]
    offset: tuple[int, ...]


Plan = dict[str, list[Box] | None]  # None: not one box per rank (strided FSDP x TP shards), gathered whole
Targets = dict[str, dict[str | None, list[str]]]


def _box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    from torch.distributed.tensor import DTensor

    from forge_rl.deps.pytorch import local_shape_and_global_offset
    from forge_rl.weights.shards import is_box_sharded

    if not isinstance(param, DTensor):
        return tuple(param.shape), (0,) * param.dim()
    return local_shape_and_global_offset(param) if is_box_sharded(param) else None


def plan(model: torch.nn.Module, world: int) -> Plan:
    """Which rank sends which box of each parameter: each distinct non-empty box once, from the lowest rank that
    holds it (TP-replicated and unsharded parameters are sent by one rank). A collective: every rank calls it."""
    import torch.distributed as dist

    mine = {name: _box(param) for name, param in model.named_parameters()}
    everyone: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    result: Plan = {}
    for name in mine:
        boxes = [held[name] for held in everyone]
        if any(b is None for b in boxes):
            result[name] = None
            continue
        senders: dict[tuple, int] = {}
        for rank, (shape, offset) in enumerate(boxes):
            if math.prod(shape) > 0:  # uneven sharding leaves some ranks nothing
                senders.setdefault((shape, offset), rank)
        result[name] = [Box(src, shape, offset) for (shape, offset), src in senders.items()]
    return result


def spec(model: torch.nn.Module, targets: Targets, dtype: torch.dtype, heads_per_kv: int,
         head_dim: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The version's tensors (HF names) and their shapes, from the parameters' global shapes."""
    out = {}
    for name, param in model.named_parameters():
        whole = torch.empty(param.shape, dtype=dtype, device="meta")
        parts = fused_qkv.split(whole, heads_per_kv, head_dim) if None not in targets[name] else {None: whole}
        for part, tensor in parts.items():
            for hf_name in targets[name][part]:
                out[hf_name] = (dtype, tuple(tensor.shape))
    return out


def stream(model: torch.nn.Module, plan: Plan, targets: Targets, writer, rank: int, dtype: torch.dtype,
           device: torch.device, block_bytes: int, heads_per_kv: int, head_dim: int) -> int:
    """Every rank sends its boxes to rank 0, which writes them (`writer` is used on rank 0 only). Parameters go in
    the same order on every rank; each block is a point-to-point send, so ranks that hold nothing of a parameter
    move on. Returns the largest block this rank held, in bytes."""
    import torch.distributed as dist

    held = 0
    for name, param in model.named_parameters():
        boxes = plan[name]
        if boxes is None:  # the fallback: a collective every rank joins, the tensor whole on each
            whole = param.detach().to(dtype).full_tensor()
            held = max(held, whole.nbytes)
            if rank == 0:
                _write(writer, targets[name], whole, (0,) * whole.dim(), heads_per_kv, head_dim)
            continue
        local = _local(param).detach()
        for box in boxes:
            if rank not in (0, box.src):
                continue
            for r0, r1 in row_blocks(box.shape, dtype.itemsize, block_bytes):
                if rank == box.src:
                    block = local[r0:r1].to(dtype).contiguous()
                    if rank != 0:
                        dist.send(block, dst=0)
                else:
                    block = torch.empty((r1 - r0, *box.shape[1:]), dtype=dtype, device=device)
                    dist.recv(block, src=box.src)
                held = max(held, block.nbytes)
                if rank == 0:
                    _write(writer, targets[name], block, (box.offset[0] + r0, *box.offset[1:]), heads_per_kv,
                           head_dim)
                del block
    return held


def _write(writer, target: dict[str | None, list[str]], block: torch.Tensor, offset: tuple[int, ...],
           heads_per_kv: int, head_dim: int) -> None:
    """A block of a parameter at `offset` into the version: as is, or a fused q/k/v block's rows into wq/wk/wv."""
    if None in target:
        for hf_name in target[None]:
            writer.write(hf_name, block, offset=offset)
        return
    row = 0
    for part, first, end in fused_qkv.rows(offset[0], offset[0] + block.shape[0], heads_per_kv, head_dim):
        for hf_name in target[part]:
            writer.write(hf_name, block[row : row + end - first], offset=(first, *offset[1:]))
        row += end - first


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param
