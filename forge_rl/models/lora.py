"""LoRA on TorchTitan's Qwen3, and its adapters in PEFT's format.

The trainer converts the model config with TorchTitan's own `LoRAConverter` before building: target
linears become `LoRALinear` (frozen base, trainable `lora_a` [r, in] and `lora_b` [out, r], output
`base(x) + alpha/r * lora_b(lora_a(x))`), every other parameter is frozen. The converter derives the
adapters' tensor-parallel sharding from the base linear's (colwise: `lora_b` sharded like the base's
rows; rowwise: `lora_a` sharded like its columns), and FSDP2 shards them like any other parameter.

Targets are named as Hugging Face and PEFT name them (`q_proj`, `o_proj`, `gate_proj`, ...), since that is
what a user reads in a model card and what vLLM and `peft` load. TorchTitan fuses q/k/v into one `wqkv`
linear, so its adapter has one `lora_a` shared by q, k and v and one `lora_b` over the fused rows: in PEFT
terms q_proj, k_proj and v_proj each get that same A and their own rows of B, which is the same function.
q_proj, k_proj and v_proj are therefore targeted together or not at all.
"""

import torch
import torch.nn.functional as F

from forge_rl.models.lora_config import QKV, TITAN_NAME, LoRAConfig

# TorchTitan FQN (after `layers.N.`) -> HF FQN (after `model.layers.N.`), for the unfused modules
_HF_MODULE = {
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def is_adapter_key(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


def convert(model_config, cfg: LoRAConfig):
    """The model config with LoRA linears on `cfg.targets` and everything else frozen (TorchTitan's
    LoRAConverter). Call after the TP plans are on the config: adapters take their sharding from them."""
    from torchtitan.components.lora import LoRAConverter

    targets = sorted({TITAN_NAME[t] for t in cfg.targets})
    return LoRAConverter(LoRAConverter.Config(rank=cfg.rank, alpha=cfg.alpha, target_modules=targets)).convert(
        model_config
    )


def initial_adapters(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Full initial adapter tensors, the same for any parallelism and any number of ranks (a rank's own
    random init would depend on its shard): lora_a ~ U(-1/sqrt(in), 1/sqrt(in)) as PEFT's kaiming-uniform
    default, lora_b = 0, so training starts from exactly the base model."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        if ".lora_a." in name:
            bound = shape[1] ** -0.5
            out[name] = (torch.rand(shape, generator=g) * 2 - 1) * bound
        else:
            out[name] = torch.zeros(shape)
    return out


def add_dropout(model: torch.nn.Module, p: float) -> None:
    """Dropout on every adapter's input (PEFT's lora_dropout), active in training forwards only."""
    if not p:
        return
    for name, module in model.named_modules():
        if name.endswith(".lora_a"):
            module.register_forward_pre_hook(lambda m, args: (F.dropout(args[0], p, m.training), *args[1:]))


def to_peft(adapters: dict[str, torch.Tensor], head_dim: int, heads_per_kv: int) -> dict[str, torch.Tensor]:
    """TorchTitan adapter tensors (full, `layers.N.<module>.lora_{a,b}.weight`) -> PEFT's names
    (`base_model.model.model.layers.N.<hf module>.lora_{A,B}.weight`), the fused wqkv split into q/k/v."""
    out = {}
    for name, tensor in adapters.items():
        layer, rest = _split_layer(name)
        module, which = rest.rsplit(".lora_", 1)
        ab = "A" if which.startswith("a") else "B"
        prefix = f"base_model.model.model.layers.{layer}."
        if module == "attention.qkv_linear.wqkv":
            parts = (
                dict(zip(QKV, split_qkv_rows(tensor, head_dim, heads_per_kv)))
                if ab == "B"
                else {t: tensor.clone() for t in QKV}
            )  # one A each: PEFT files hold no shared storage
            for proj, part in parts.items():
                out[f"{prefix}self_attn.{proj}.lora_{ab}.weight"] = part.contiguous()
        elif module in _HF_MODULE:
            out[f"{prefix}{_HF_MODULE[module]}.lora_{ab}.weight"] = tensor
        else:
            raise KeyError(f"{name}: no PEFT name for this adapter")
    return out


def split_qkv_rows(t: torch.Tensor, head_dim: int, heads_per_kv: int) -> tuple[torch.Tensor, ...]:
    """Rows of a fused wqkv tensor ([n_kv * (heads_per_kv + 2) * head_dim, ...], grouped per KV head) as
    (q rows, k rows, v rows), the way TorchTitan's FusedQKVLinear splits its weight on save."""
    r = heads_per_kv + 2
    w = t.reshape(-1, r, head_dim, *t.shape[1:])
    return (
        w[:, :heads_per_kv].reshape(-1, *t.shape[1:]),
        w[:, heads_per_kv].reshape(-1, *t.shape[1:]),
        w[:, heads_per_kv + 1].reshape(-1, *t.shape[1:]),
    )


class MergingWriter:
    """A writer of HF weights that adds each adapted module's alpha/r B @ A to the blocks written through it: a LoRA
    run's merged export, streamed a block of rows at a time like any other (Trainer.export_hf). `peft`: the adapters,
    whole (they are small), PEFT names."""

    def __init__(self, writer, peft: dict[str, torch.Tensor], cfg: LoRAConfig):
        self.writer, self.scale = writer, cfg.alpha / cfg.rank
        self.ab = {
            name[len("base_model.model.") : -len(".lora_A.weight")] + ".weight": (
                peft[name.replace(".lora_A.", ".lora_B.")].float(),
                a.float(),
            )
            for name, a in peft.items()
            if name.endswith(".lora_A.weight")
        }

    def write(self, name: str, block: torch.Tensor, offset: tuple[int, ...] | None = None) -> None:
        if name in self.ab:
            b, a = self.ab[name]
            (r0, c0), (rows, cols) = offset or (0, 0), block.shape
            delta = b[r0 : r0 + rows] @ a[:, c0 : c0 + cols]
            block = (block.float() + self.scale * delta.to(block.device)).to(block.dtype)
        self.writer.write(name, block, offset=offset)


def _split_layer(name: str) -> tuple[int, str]:
    if not name.startswith("layers."):
        raise KeyError(f"{name}: adapters are expected on the decoder layers only")
    _, layer, rest = name.split(".", 2)
    return int(layer), rest
