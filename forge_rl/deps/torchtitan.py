"""TorchTitan 0.3.0 names forge_rl builds on that TorchTitan keeps private, and a fix of its device choice.

- Before anything of TorchTitan is imported: the torch 2.12 names its modules import, given placeholders on an older
  torch (forge_rl/deps/torch_for_torchtitan.py: a site PyTorch 2.11 runs forge_rl's trainer).
- `use_cpu_without_accelerator()`: `torchtitan.tools.utils.device_type` falls back to "cuda" when torch
  reports no accelerator, and several TorchTitan modules copy it at import time; on a CPU-only machine it must
  be "cpu" before any `torchtitan.models` / `torchtitan.distributed` import. Importing this module does it.
- `buffers_left_uninitialised(modules)`: `init_states` leaves those modules' own buffers alone (TorchTitan's
  per-module `_init_self_buffers` hook), so that one RoPE cache can stand for every layer's.
- `build_qwen3_layers`, `build_qwen3_moe_layers`, `qwen3_norm`, `EMBEDDING_INIT`, `LINEAR_INIT`: how TorchTitan's
  own Qwen3 configs are built (per-layer block configs, the RMSNorm config, its initialisers). forge_rl builds a
  Qwen3 config from
  any HF config.json with them instead of copying their code; TorchTitan exports only fixed model flavours.
"""

import contextlib

import torch

from forge_rl.deps import torch_for_torchtitan

torch_for_torchtitan.provide()  # before TorchTitan's first import: its FSDP module imports a torch 2.12 name

import torchtitan.tools.utils as _utils  # noqa: E402


def use_cpu_without_accelerator() -> None:
    if _utils.device_type == "cuda" and not torch.cuda.is_available():
        _utils.device_type, _utils.device_module = "cpu", torch.cpu


use_cpu_without_accelerator()  # before the model imports below, which copy the device type

from torchtitan.models.qwen3 import _EMBEDDING_INIT as EMBEDDING_INIT  # noqa: E402
from torchtitan.models.qwen3 import _LINEAR_INIT as LINEAR_INIT  # noqa: E402
from torchtitan.models.qwen3 import _build_qwen3_layers as build_qwen3_layers  # noqa: E402
from torchtitan.models.qwen3 import _build_qwen3_moe_layers as build_qwen3_moe_layers  # noqa: E402
from torchtitan.models.qwen3 import _qwen3_norm as qwen3_norm  # noqa: E402


@contextlib.contextmanager
def buffers_left_uninitialised(modules):
    for module in modules:
        module._init_self_buffers = lambda **_: None  # shadows the class's hook on this instance
    try:
        yield
    finally:
        for module in modules:
            del module._init_self_buffers


__all__ = [
    "EMBEDDING_INIT",
    "LINEAR_INIT",
    "buffers_left_uninitialised",
    "build_qwen3_layers",
    "build_qwen3_moe_layers",
    "qwen3_norm",
    "use_cpu_without_accelerator",
]


@contextlib.contextmanager
def balanced_routing():
    """Within: every Qwen3-MoE router sends token t's k-th choice to expert (t*K + k) mod E (TorchTitan's own
    `_debug_force_load_balance` order), and an expert-parallel rank's count exchange answers what an evenly loaded EP
    group would send it (its own counts for its experts, from every peer). For the rehearsal
    (forge_rl/rehearsal), whose fake tensors carry no scores to route by and whose fake process group moves no
    data: the routing is then the evenly loaded one, with real token counts and real all-to-all sizes.

    The expert ids are made from a numpy array, which no dispatch mode sees: real however many there are (the
    rehearsal's memory keeps integer tensors made out of nothing real only up to 16 MiB, and fake ids would read as
    token counts of 0). A clone of them is what the router returns, so that a dispatch mode counts their bytes."""
    import numpy as np
    from torchtitan.models.common.moe import TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    route, exchange = TokenChoiceTopKRouter.forward, AllToAllTokenDispatcher._token_count_exchange
    debug_ids = TokenChoiceTopKRouter._debug_force_load_balance_routing

    def balanced_route(self, *args, **kwargs):
        self._debug_force_load_balance = True
        return route(self, *args, **kwargs)

    def balanced_ids(self, scores_BLE):
        B, L, _ = scores_BLE.shape
        ids = np.arange(B * L * self.top_k, dtype=np.int64).reshape(B, L, self.top_k) % self.num_experts
        ids_BLK = torch.from_numpy(ids).to(scores_BLE.device).clone()
        return ids_BLK, scores_BLE.gather(dim=-1, index=ids_BLK)

    def even_exchange(self, counts_E, pg, ep_size):
        mine = counts_E.view(ep_size, -1)[self.ep_mesh.get_local_rank()]
        return mine.expand(ep_size, -1).contiguous()

    TokenChoiceTopKRouter.forward, AllToAllTokenDispatcher._token_count_exchange = balanced_route, even_exchange
    TokenChoiceTopKRouter._debug_force_load_balance_routing = balanced_ids
    try:
        yield
    finally:
        TokenChoiceTopKRouter.forward, AllToAllTokenDispatcher._token_count_exchange = route, exchange
        TokenChoiceTopKRouter._debug_force_load_balance_routing = debug_ids
