"""Build the embedded tiny mixture-of-experts model `tiny-moe`: tiny-warm's Qwen3 made sparse.

    python -m forge_rl.models.build_tiny_moe [--out forge_rl/models/tiny_moe]

An HF `Qwen3MoeForCausalLM` directory (config.json, model.safetensors, tiny-warm's tokenizer files) that
transformers, vLLM and TorchTitan's Qwen3-MoE load. Every MLP of tiny-warm becomes NUM_EXPERTS experts, top
TOP_K of them per token:

- embeddings, attention and norms are tiny-warm's, copied;
- each expert is tiny-warm's MLP of that layer plus Gaussian noise of EXPERT_NOISE times the weight's own standard
  deviation (each expert its own draw), so the experts differ and routing matters, while the mixture stays close
  to the dense MLP (Qwen3-MoE renormalises the top-k weights to sum to 1: identical experts would give exactly the
  dense model whatever the router says);
- the router is random, N(0, ROUTER_STD): near-uniform routing at the start, which training then shapes.

So GRPO starts from tiny-warm's arithmetic instead of from zero. The weights are stored in bfloat16 (the
checkpoint is 5.6 MB instead of 11); every reader upcasts them to its own dtype. Deterministic: a fixed seed,
tests/integration/test_moe.py rebuilds it and compares bit for bit.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).parent / "tiny_moe"
WARM = Path(__file__).parent / "tiny_warm"
SEED = 0
NUM_EXPERTS = 4
TOP_K = 2
EXPERT_NOISE = 0.05  # relative to each weight's standard deviation
ROUTER_STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def moe_config(dense: dict) -> dict:
    """The HF Qwen3-MoE config of tiny-warm's dense config `dense`: every layer sparse, no dense MLP layers."""
    keep = {k: v for k, v in dense.items() if k not in ("architectures", "model_type", "intermediate_size")}
    return dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        **keep,
        intermediate_size=dense["intermediate_size"],
        moe_intermediate_size=dense["intermediate_size"],
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    ) | {"torch_dtype": "bfloat16"}


def moe_weights(
    dense: dict[str, torch.Tensor], n_layers: int, hidden: int, seed: int = SEED
) -> dict[str, torch.Tensor]:
    """tiny-warm's tensors with each layer's MLP turned into NUM_EXPERTS perturbed copies and a router."""
    gen = torch.Generator().manual_seed(seed)
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}.mlp."
        for e in range(NUM_EXPERTS):
            for part in MLP_PARTS:
                w = dense[f"{prefix}{part}.weight"]
                noise = torch.randn(w.shape, generator=gen) * (EXPERT_NOISE * float(w.std()))
                out[f"{prefix}experts.{e}.{part}.weight"] = w + noise
        out[f"{prefix}gate.weight"] = torch.randn((NUM_EXPERTS, hidden), generator=gen) * ROUTER_STD
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(out.items())}


def build(out: Path, warm: Path = WARM) -> Path:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    dense_config = json.loads((warm / "config.json").read_text())
    config = moe_config(dense_config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(warm / name, out / name)
    weights = moe_weights(
        load_file(str(warm / "model.safetensors")), config["num_hidden_layers"], config["hidden_size"]
    )
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    from safetensors.torch import load_file

    out = build(parser.parse_args().out)
    tensors = load_file(str(out / "model.safetensors"))
    n = sum(t.numel() for name, t in tensors.items() if name != "lm_head.weight")
    print(
        f"wrote {out} ({n:,} parameters, {NUM_EXPERTS} experts of which {TOP_K} per token; "
        f"{(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)"
    )


if __name__ == "__main__":
    main()
