"""Writing a sharded model's weights under HF names without gathering any tensor whole.

Every trainer rank holds one box (a contiguous block) of each parameter: its FSDP2 / TP shard, including FSDP2's
strided shards of TP-sharded dim-0 parameters (FSDP over TP: each rank's rows are still one block of the whole
tensor). `plan` says which rank sends which box: each distinct box once, from the lowest rank holding it. Then:

- `write_own`: ranks on one host each write their own boxes straight into the version's file (shared memory),
  a block of rows at a time converted to the publish dtype;
- `stream_to_rank0`: ranks on several hosts (a rank cannot write another host's shared memory), and the HF
  export (one writer: rank 0) send rank 0 their boxes a block of rows at a time; rank 0 writes each block.

Either way no rank holds a whole tensor, only one block of at most `block_bytes` beyond its shard, and a fused
q/k/v block is split into its q, k and v rows as it is written (forge_rl/models/fused_qkv.py).

    plan = sharded_publish.plan(model, world)                   # once: a collective, boxes of every rank
    spec = sharded_publish.spec(model, targets, dtype, heads_per_kv, head_dim)
    held = sharded_publish.write_own(model, plan, targets, writer, rank, dtype, block_bytes, ...)   # or
    held = sharded_publish.stream_to_rank0(model, plan, targets, writer, rank, dtype, device, block_bytes, ...)

`targets` maps each parameter to its HF names: {part: [names]}, part None for a plain tensor or wq / wk / wv for
TorchTitan's fused q/k/v; a tied embedding also names lm_head.weight. A Qwen3-MoE layer's grouped experts ([E, ...],
one parameter) map to {EXPERTS: [one name per expert]}: a box of experts e0..e1 is written as each expert's own
tensor (vLLM's per-expert layout), so no rank holds more experts than its own.
"""

import math
from dataclasses import dataclass

import torch

from forge_rl.models import fused_qkv
from forge_rl.weights.shards import box_of, row_blocks


@dataclass(frozen=True)
class Box:
    """A block of a parameter that one rank holds and sends: `src` is the lowest rank holding it."""

    src: int
    shape: tuple[int, ...]
    offset: tuple[int, ...]


Plan = dict[str, list[Box]]
EXPERTS = "experts"  # the part of a grouped expert parameter: dim 0 is the expert, one HF tensor each
Targets = dict[str, dict[str | None, list[str]]]


class NotTiled(ValueError):
    """The ranks' boxes of a parameter do not cover it exactly once: its placements are not blocks per rank."""


def plan(model: torch.nn.Module, world: int) -> Plan:
    """Which rank sends which box of each parameter: each distinct non-empty box once, from the lowest rank that
    holds it (TP-replicated and unsharded parameters are sent by one rank). A collective: every rank calls it.
    Raises NotTiled when the distinct boxes do not cover a parameter exactly once."""
    import torch.distributed as dist

    mine = {name: box_of(param) for name, param in model.named_parameters()}
    everyone: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    result: Plan = {}
    for name, param in model.named_parameters():
        senders: dict[tuple, int] = {}
        for rank, held in enumerate(everyone):
            shape, offset = held[name]
            if math.prod(shape) > 0:  # uneven sharding leaves some ranks nothing
                senders.setdefault((shape, offset), rank)
        result[name] = [Box(src, shape, offset) for (shape, offset), src in senders.items()]
        check_tiling(name, tuple(param.shape), result[name])
    return result


def check_tiling(name: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Assert the boxes cover a tensor of `shape` exactly once: their volumes add up to the tensor's and no two
    overlap. A strided placement that left a rank rows from two places would fail here instead of publishing
    wrong weights."""
    volume = sum(math.prod(b.shape) for b in boxes)
    if volume != math.prod(shape):
        raise NotTiled(
            f"{name}: the ranks' blocks hold {volume} elements of {math.prod(shape)} ({shape}); "
            f"its placements do not leave each rank one block"
        )
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offset, a.shape, b.offset, b.shape)):
                raise NotTiled(f"{name}: ranks {a.src} and {b.src} hold overlapping blocks {a} and {b}")


def spec(
    model: torch.nn.Module, targets: Targets, dtype: torch.dtype, heads_per_kv: int, head_dim: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The version's tensors (HF names) and their shapes, from the parameters' global shapes."""
    out = {}
    for name, param in _published(model, targets):
        whole = torch.empty(param.shape, dtype=dtype, device="meta")
        if EXPERTS in targets[name]:
            for hf_name in targets[name][EXPERTS]:
                out[hf_name] = (dtype, tuple(param.shape[1:]))
            continue
        parts = fused_qkv.split(whole, heads_per_kv, head_dim) if None not in targets[name] else {None: whole}
        for part, tensor in parts.items():
            for hf_name in targets[name][part]:
                out[hf_name] = (dtype, tuple(tensor.shape))
    return out


def write_own(
    model: torch.nn.Module,
    plan: Plan,
    targets: Targets,
    writer,
    rank: int,
    dtype: torch.dtype,
    block_bytes: int,
    heads_per_kv: int,
    head_dim: int,
) -> int:
    """This rank writes the boxes it sends (plan) into `writer`, a block of rows at a time in `dtype`; no
    communication. Returns the largest block it converted, in bytes (0 where no conversion was needed)."""
    held = 0
    for name, param in _published(model, targets):
        local = _local(param).detach()
        for box in plan[name]:
            if box.src != rank:
                continue
            for r0, r1 in row_blocks(box.shape, dtype.itemsize, block_bytes):
                block = local[r0:r1].to(dtype)  # a view where the dtype already matches
                if block.dtype != local.dtype:
                    held = max(held, block.nbytes)
                _write(writer, targets[name], block, (box.offset[0] + r0, *box.offset[1:]), heads_per_kv, head_dim)
                del block
    return held


def stream_to_rank0(
    model: torch.nn.Module,
    plan: Plan,
    targets: Targets,
    writer,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    block_bytes: int,
    heads_per_kv: int,
    head_dim: int,
) -> int:
    """Every rank sends its boxes to rank 0, which writes them (`writer` is used on rank 0 only). Parameters go in
    the same order on every rank; each block is a point-to-point send, so ranks that hold nothing of a parameter
    move on. Returns the largest block this rank held, in bytes."""
    import torch.distributed as dist

    held = 0
    for name, param in _published(model, targets):
        local = _local(param).detach()
        for box in plan[name]:
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
                    _write(writer, targets[name], block, (box.offset[0] + r0, *box.offset[1:]), heads_per_kv, head_dim)
                del block
    return held


def _write(
    writer,
    target: dict[str | None, list[str]],
    block: torch.Tensor,
    offset: tuple[int, ...],
    heads_per_kv: int,
    head_dim: int,
) -> None:
    """A block of a parameter at `offset` into the version: as is, each expert of a grouped expert block into its
    own tensor, or a fused q/k/v block's rows into wq/wk/wv."""
    if EXPERTS in target:
        for i in range(block.shape[0]):
            writer.write(target[EXPERTS][offset[0] + i], block[i], offset=offset[1:])
        return
    if None in target:
        for hf_name in target[None]:
            writer.write(hf_name, block, offset=offset)
        return
    row = 0
    for part, first, end in fused_qkv.rows(offset[0], offset[0] + block.shape[0], heads_per_kv, head_dim):
        for hf_name in target[part]:
            writer.write(hf_name, block[row : row + end - first], offset=(first, *offset[1:]))
        row += end - first


def _published(model: torch.nn.Module, targets: Targets):
    """The parameters that have HF names (not LoRA's adapters), in the same order on every rank."""
    return ((name, param) for name, param in model.named_parameters() if name in targets)


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param
