"""Model FLOPs utilisation (forge_rl/observability/mfu.py): the FLOPs count against the models' real parameters,
the device table, and the measured rate where the table has no entry."""

import pytest
import torch

from forge_rl.models import qwen3, resolve_model_path
from forge_rl.observability.mfu import (
    device_peak_flops,
    flops_per_token,
    matmul_parameters,
    measured_matmul_flops,
    mfu,
    table_peak,
)


@pytest.mark.parametrize("name", ["tiny-warm", "tiny-moe"])
def test_matmul_parameters_are_the_models_own_with_a_tokens_share_of_the_experts(name):
    """Every weight a token is multiplied by: each layer's matrices (of a mixture of experts, the router and the
    top-k of its experts), and the lm_head once (tied or not); not the embedding lookup, not the norms."""
    model_dir = resolve_model_path(name)
    hf = qwen3.read_hf_config(model_dir)
    model, _ = qwen3.build_model(model_dir)
    share = hf["num_experts_per_tok"] / hf["num_experts"] if hf.get("num_experts") else 1.0
    counted = sum(
        p.numel() * (share if "routed_experts" in n else 1.0)
        for n, p in model.named_parameters()
        if p.ndim >= 2 and n.startswith("layers.")
    )
    assert matmul_parameters(hf) == counted + hf["vocab_size"] * hf["hidden_size"]


def test_flops_per_token_adds_causal_attention_growing_with_the_row():
    hf = qwen3.read_hf_config(resolve_model_path("tiny-warm"))
    short, long = flops_per_token(hf, 64), flops_per_token(hf, 128)
    width = hf["num_attention_heads"] * (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    assert short > 6 * matmul_parameters(hf)
    assert long - short == 6 * hf["num_hidden_layers"] * 64 * width
    # 1,000 tokens of rows of 64 in 1 s on two devices of 1 GFLOP/s each
    assert mfu(hf, 1000, 64, 1.0, 1e9, devices=2) == pytest.approx(short * 1000 / 2e9)


def test_the_table_takes_the_most_specific_name_and_knows_nothing_of_others():
    assert table_peak("NVIDIA H100 PCIe") == 756e12
    assert table_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert table_peak("NVIDIA H200") == 989e12
    assert table_peak("NVIDIA GeForce RTX 2060") is None


def test_a_device_not_in_the_table_is_measured():
    peak, source = device_peak_flops(torch.device("cpu"))
    # the faster of bf16 and fp32: a CPU without bf16 instructions emulates a bf16 matmul below a GFLOP/s
    assert source == "measured" and peak >= measured_matmul_flops(torch.device("cpu"), dtype=torch.float32) / 2
    assert peak > 1e9
    torch.manual_seed(0)
    assert measured_matmul_flops(torch.device("cpu"), n=256, seconds=0.01) > 0
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))  # measuring draws nothing: a seeded run's randomness is its own
