"""What dense Qwen3 (qwen3.py) and Qwen3-MoE (qwen3_moe.py) share of their TorchTitan config, read from a
Hugging Face `config.json`: the HF config itself, attention's shape (head_dim, RoPE), and the whole model's config
around its layers, whose attention is SDPA (`MaskedSDPA`).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# first: it makes TorchTitan's device type "cpu" without an accelerator, before its model modules import
from forge_rl.deps.torchtitan import EMBEDDING_INIT, LINEAR_INIT, qwen3_norm
from forge_rl.models.norms import cast_norm

from torchtitan.models.common import CosSinRoPE, Embedding, Linear  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model  # noqa: E402


class MaskedSDPA(ScaledDotProductAttention):
    """TorchTitan's SDPA inner attention, plus a dense boolean mask [B, 1, L, L] when one is passed as
    `attention_masks` (shared-prompt packing, forge_rl.data.prompt_packing); causal otherwise. SDPA with
    a dense mask runs forward and backward on CPU and CUDA, where flex attention has no CPU backward."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if attention_masks is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, **kwargs)
        if not isinstance(attention_masks, torch.Tensor) or attention_masks.dtype != torch.bool:
            raise TypeError(f"MaskedSDPA takes a bool tensor mask, got {type(attention_masks).__name__}")
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            attn_mask=attention_masks,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; a model path must be an HF model directory with config.json")
    return json.loads(path.read_text())


def attention_pair_cost(hf: dict) -> float:
    """What attention costs a forward per (query, key) pair, in units of what one token costs through the layers'
    linear maps (q/k/v/o and the MLP; a mixture of experts': its routed experts'). The two grow apart with the
    row's length L: a row costs L x (1 + L x this), which is what shared-prompt packing weighs
    (forge_rl.data.prompt_packing)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    hidden, q_width = hf["hidden_size"], hf["num_attention_heads"] * head_dim
    kv_width = hf["num_key_value_heads"] * head_dim
    if hf.get("num_experts"):
        mlp = hf["num_experts_per_tok"] * 3 * hidden * hf["moe_intermediate_size"]
    else:
        mlp = 3 * hidden * hf["intermediate_size"]
    linear = hidden * (2 * q_width + 2 * kv_width) + mlp  # multiply-adds per token per layer
    return 2 * q_width / linear  # q.k and the weighted sum of v: per pair, per layer


def attention_shape(hf: dict) -> tuple[int, CosSinRoPE.Config]:
    """(head_dim, RoPE config) of an HF Qwen3 config."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
    return head_dim, CosSinRoPE.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=theta)


def model_config(hf: dict, layers: list) -> Qwen3Model.Config:
    """The whole model's config around `layers`, each layer's attention made SDPA and its norms the checkpoint's
    eps, every norm computing in its input's dtype (forge_rl/models/norms.py)."""
    dim, vocab = hf["hidden_size"], hf["vocab_size"]
    for layer in layers:
        layer.attention.inner_attention = MaskedSDPA.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = hf.get("rms_norm_eps", 1e-6)
        layer.attention_norm, layer.ffn_norm = cast_norm(layer.attention_norm), cast_norm(layer.ffn_norm)
        if layer.attention.qk_norm is not None:
            layer.attention.qk_norm = cast_norm(layer.attention.qk_norm)
        # Every weight is then read from the checkpoint, so the initial values never matter; TorchTitan's fused
        # q/k/v init draws whole q, k, v and the whole fused weight on every rank, then keeps its shard (a whole
        # layer's q/k/v per rank). Each rank draws its own shard, as for the other linears.
        layer.attention.qkv_linear.wqkv.param_init = LINEAR_INIT
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=cast_norm(qwen3_norm(dim)),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=LINEAR_INIT),
        layers=layers,
    )
