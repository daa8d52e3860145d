"""A checkpoint the size of a real one that costs nothing: a safetensors file with a real header and no data.

    model_dir = write_sparse_checkpoint(tmp, QWEN3_SHAPES["Qwen3-32B"])   # config.json + model.safetensors
    with fake_reads(memory):                                               # reads give fake tensors
        load_sharded(model, adapter, model_dir)                            # the loader's own code, unchanged

The file is sparse (its size is the checkpoint's, 65.5 GB at 32B, but no block is allocated), so `safe_open` finds
every tensor's name, dtype, shape and offset as in a real one. Under `fake_reads`, reading a slice of a tensor
gives a fake tensor of the slice's shape and dtype (forge_rl/rehearsal/fake_memory.py), counted by the rank's
memory: the loader's block-by-block reading, shard arithmetic and fused q/k/v assembly run as written.
"""

import contextlib
import json
import math
import struct
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def hf_config(shape: dict, layers: int | None = None) -> dict:
    """An HF Qwen3 (or Qwen3-MoE) config.json from memory_plan's QWEN3_SHAPES entry, with `layers` decoder layers
    if given; a vision-language shape's (rehearsal/vision.py VISION_SHAPES) Idefics3 config.json."""
    if "vision_config" in shape:
        from forge_rl.rehearsal.vision import vision_hf_config

        return vision_hf_config(shape, layers)
    moe = shape.get("model_type") == "qwen3_moe"
    base = dict(
        architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
        attention_bias=False,
        torch_dtype="bfloat16",
        eos_token_id=2,
        pad_token_id=0,
    )
    if moe:  # Qwen3-MoE's released layout: every layer sparse, top-k weights renormalised
        base |= dict(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return {**base, **shape, "num_hidden_layers": layers or shape["num_hidden_layers"]}


def checkpoint_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes of a Qwen3 (or Qwen3-MoE: a router and one tensor per expert and projection)
    checkpoint; an untied model has its lm_head."""
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    experts, moe_inter = cfg.get("num_experts", 0), cfg.get("moe_intermediate_size", 0)
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if experts:
            shapes[p + "mlp.gate.weight"] = (experts, h)
            for e in range(experts):
                x = f"{p}mlp.experts.{e}."
                shapes |= {
                    x + "gate_proj.weight": (moe_inter, h),
                    x + "up_proj.weight": (moe_inter, h),
                    x + "down_proj.weight": (h, moe_inter),
                }
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
    return shapes


def write_sparse_checkpoint(out: Path, cfg: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """`out`/config.json and `out`/model.safetensors: a real safetensors header, then a hole the size of the data;
    a vision-language model's processor files too (forge_rl/rehearsal/vision.py). Returns `out`."""
    from forge_rl.rehearsal.vision import vision_checkpoint_tensors, write_processor_files

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    vision = "vision_config" in cfg
    tensors = vision_checkpoint_tensors(cfg, checkpoint_tensors) if vision else checkpoint_tensors(cfg)
    if vision:
        write_processor_files(out, cfg)
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors.items():
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = dict(dtype=SAFETENSORS_DTYPES[dtype], shape=list(shape), data_offsets=[at, at + nbytes])
        at += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + at)  # sparse: no block of the data is written
    return out


class _FakeSlice:
    """What `safe_open(...).get_slice(name)` returns, except that indexing makes a fake tensor instead of reading."""

    def __init__(self, real, memory):
        self.real, self.memory = real, memory

    def get_shape(self):
        return self.real.get_shape()

    def get_dtype(self):
        return self.real.get_dtype()

    def __getitem__(self, index) -> torch.Tensor:
        from forge_rl.weights.layout import dtype_of

        index = index if isinstance(index, tuple) else (index,)
        shape = list(self.get_shape())
        for d, s in enumerate(index):
            shape[d] = len(range(*s.indices(shape[d])))
        with self.memory.fake:
            tensor = torch.empty(shape, dtype=dtype_of(self.get_dtype()))
        self.memory.count(tensor)
        self.memory.host_read(tensor.nbytes)
        return tensor


class _FakeHandle:
    def __init__(self, real, memory):
        self.real, self.memory = real, memory

    def keys(self):
        return self.real.keys()

    def get_slice(self, name: str) -> _FakeSlice:
        return _FakeSlice(self.real.get_slice(name), self.memory)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]


@contextlib.contextmanager
def fake_reads(memory):
    """Within: `safetensors.safe_open` opens the real file (its header) and reads fake tensors."""
    import safetensors

    real_open = safetensors.safe_open

    def safe_open(path, framework="pt", device="cpu"):
        return _FakeHandle(real_open(path, framework=framework, device=device), memory)

    safetensors.safe_open = safe_open
    try:
        yield
    finally:
        safetensors.safe_open = real_open
