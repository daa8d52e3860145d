"""TorchTitan's fused q/k/v weight (`FusedQKVLinear.wqkv`) in terms of the checkpoint's q_proj, k_proj, v_proj.

The fused rows are grouped by KV head: for each, its heads_per_kv query heads, then its key head, then its value
head, head_dim rows each. TorchTitan converts with state-dict hooks that gather whole q, k and v on every rank;
loading (forge_rl/models/sharded_load.py) and cross-host publishing (Trainer.push_weights) use these instead,
so no rank holds more than its own rows, or one layer's fused weight.
"""

import torch

SUFFIX = "wqkv.weight"  # the fused parameter's name ends so; its module's prefix + wq/wk/wv.weight are the parts
PARTS = ("wq", "wk", "wv")


def rows(start: int, stop: int, heads_per_kv: int, head_dim: int) -> list[tuple[str, int, int]]:
    """Where fused rows [start, stop) come from, as (part, first row, end row) runs of wq, wk or wv."""
    runs, row = [], start
    slots = heads_per_kv + 2
    while row < stop:
        group, slot, within = row // (slots * head_dim), (row // head_dim) % slots, row % head_dim
        n = min(stop - row, head_dim - within)  # to the end of this head, at most
        if slot < heads_per_kv:
            first = (group * heads_per_kv + slot) * head_dim + within
            runs.append(("wq", first, first + n))
        else:
            first = group * head_dim + within
            runs.append(("wk" if slot == heads_per_kv else "wv", first, first + n))
        row += n
    return runs


def split(fused: torch.Tensor, heads_per_kv: int, head_dim: int) -> dict[str, torch.Tensor]:
    """The whole fused weight [n_kv * (heads_per_kv + 2) * head_dim, dim] as {"wq": ..., "wk": ..., "wv": ...}."""
    w = fused.reshape(-1, heads_per_kv + 2, head_dim, fused.shape[-1])
    return {
        "wq": w[:, :heads_per_kv].reshape(-1, fused.shape[-1]),
        "wk": w[:, heads_per_kv].reshape(-1, fused.shape[-1]),
        "wv": w[:, heads_per_kv + 1].reshape(-1, fused.shape[-1]),
    }
