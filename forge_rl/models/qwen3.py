"""Qwen3 in TorchTitan, built from a Hugging Face model directory.

A TorchTitan model is a config dataclass; this module derives that config from an HF
`config.json` (so any Qwen3-architecture checkpoint, the embedded tiny model included, maps onto
TorchTitan's Qwen3 without a hand-written flavor) and loads HF safetensors through TorchTitan's
own `Qwen3StateDictAdapter`. What dense Qwen3 and Qwen3-MoE (qwen3_moe.py) share of that config is in
qwen3_config.py.
"""

from pathlib import Path

import torch

# first: it makes TorchTitan's device type "cpu" without an accelerator, before its model modules import
from forge_rl.deps.torchtitan import buffers_left_uninitialised, build_qwen3_layers
from forge_rl.models import qwen3_moe
from forge_rl.models.qwen3_config import attention_shape, model_config, read_hf_config
from forge_rl.models.sharded_load import load_sharded

from torchtitan.models.common.rope import RoPE  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter  # noqa: E402


def titan_config(model_dir: str | Path) -> Qwen3Model.Config:
    """TorchTitan Qwen3 config matching the HF config in `model_dir`: dense Qwen3 (`qwen3`) or Qwen3-MoE
    (`qwen3_moe`, forge_rl/models/qwen3_moe.py).

    Attention is SDPA: it runs forward and backward on CPU and CUDA, while flex attention has no CPU
    backward. Right-padded batches need no mask (causal); packed rows pass a dense one (MaskedSDPA).
    """
    hf = read_hf_config(model_dir)
    if hf.get("model_type") == "qwen3_moe":
        return qwen3_moe.titan_config(model_dir, hf)
    if hf.get("model_type") != "qwen3":
        raise ValueError(
            f"{model_dir}/config.json: model_type is {hf.get('model_type')!r}, expected 'qwen3' or 'qwen3_moe'"
        )
    return dense_config(hf)


def dense_config(hf: dict, qk_norm: bool = True) -> Qwen3Model.Config:
    """TorchTitan's dense Qwen3 config of the HF config `hf`; without `qk_norm` (no per-head q/k RMSNorm) it is a
    Llama's, whose weights have the same names and rotary convention (forge_rl/models/vision_language.py)."""
    head_dim, rope = attention_shape(hf)
    layers = build_qwen3_layers(
        n_layers=hf["num_hidden_layers"],
        dim=hf["hidden_size"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=head_dim,
        hidden_dim=hf["intermediate_size"],
        attn_backend="flex",  # replaced below; the builder only accepts masked backends
        rope=rope,
    )
    if not qk_norm:
        for layer in layers:
            layer.attention.qk_norm = None
    return model_config(hf, layers)


def build_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype=torch.float32):
    """Build TorchTitan's Qwen3 for `model_dir` and load its HF weights (one process, unsharded). Returns
    (model, adapter). The trainer builds its sharded model itself and loads it the same way."""
    config = titan_config(model_dir)
    with torch.device("meta"):
        model = config.build()
    materialise(model, torch.device(device))  # rope buffers and weight tying
    adapter = Qwen3StateDictAdapter(config, str(model_dir))
    load_sharded(model, adapter, model_dir)  # every parameter from the checkpoint, or a named error
    model = model.to(dtype)
    share_rope_caches(model)
    return model, adapter


def materialise(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)` and `init_states`, with one RoPE cache made for all the layers that share a RoPE config.

    TorchTitan gives each attention layer its own cos/sin cache of max_position_embeddings x 2 head_dim floats, and
    they are all equal: with Qwen3's 40,960 positions that is 42 MB a layer, 1.5 GB for Qwen3-8B's 36 layers and
    2.7 GB for 32B's 64, on every rank of the trainer, the reference and the critic. Making them all and sharing
    them afterwards would hold them all for a moment, past the memory plan of a role that holds little else (a
    reference); here the other layers' caches are never made."""
    followers = _rope_followers(model)
    for module in followers:
        module.cache = None  # nothing for to_empty to allocate
    with buffers_left_uninitialised(followers):
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_states(buffer_device=device)
    share_rope_caches(model)


def _rope_followers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every RoPE module but the first of each RoPE config."""
    seen, out = set(), []
    for module in model.modules():
        if isinstance(module, RoPE):
            key = repr(module.config)
            if key in seen:
                out.append(module)
            seen.add(key)
    return out


def share_rope_caches(model: torch.nn.Module) -> int:
    """Point every layer's RoPE cache at the first layer's of the same config (see `materialise`); returns the bytes
    freed. The cache is a non-persistent buffer (in no checkpoint), so sharing it changes nothing but memory; a
    `model.to(dtype)` makes each layer's its own again."""
    first, freed = {}, 0
    for module in model.modules():
        if not isinstance(module, RoPE):
            continue
        key = repr(module.config)
        if key not in first:
            first[key] = module.cache
        elif module.cache is not first[key]:
            freed += module.cache.nbytes if module.cache is not None else 0
            module.cache = first[key]
    return freed
