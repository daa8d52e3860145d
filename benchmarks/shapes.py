"""Qwen-style decoder state dicts of a given size, by HF tensor name (for the weight sync benchmarks)."""

# Qwen-style decoder shapes: (hidden, intermediate, layers, kv dim, vocab)
MODELS = {
    "100M": (768, 2048, 12, 256, 16000),
    "500M": (1536, 4096, 16, 512, 32000),
    "1.7B": (2048, 6144, 28, 1024, 151936),  # Qwen3-1.7B's hidden, MLP, layers, kv dim and vocab
}


def model_spec(size: str) -> dict[str, tuple[int, ...]]:
    h, inter, layers, kv, vocab = MODELS[size]
    head_dim = 64
    spec = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        spec |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return spec
