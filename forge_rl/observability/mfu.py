"""Model FLOPs utilisation: the FLOPs a step's tokens need, over what the device can do in that time.

    peak = device_peak_flops(device)                       # dense bf16, FLOP/s (table, else measured)
    mfu = step_flops(hf_config, tokens, seq_len) / step_s / (peak * ranks)

The FLOPs follow the usual convention (PaLM's appendix B): 6 per matmul parameter per token (forward 2, backward 4)
plus causal attention's 6 x layers x seq_len x attention width per token. Matmul parameters are the ones a token
is multiplied by: every layer's attention and MLP weights (a mixture of experts': its router and the experts each
token is routed to, not all of them) and the lm_head; the input embedding is a lookup. Both sides of a benchmark and
every run use this one count, whatever work an implementation saves (a fused head that skips prompt positions,
shared-prompt packing), so a ratio of MFUs is a ratio of speeds at equal work.

The peak is the device's dense bf16 tensor-core rate from its datasheet when the device is in the table (sparsity
not counted); elsewhere (a CPU, an unknown GPU) it is the rate of a bf16 matmul measured once per process, and on a
CPU the faster of a bf16 and an fp32 one: a CPU without bf16 instructions emulates bf16 matmuls far below the fp32
rate its bf16 autocast kernels reach.
"""

import functools
import time

import torch

# dense bf16 TFLOP/s from the vendors' datasheets (SXM parts where there are several)
PEAK_BF16_TFLOPS = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "MI300X": 1307.0,
}


def table_peak(device_name: str) -> float | None:
    """The table's FLOP/s for a device name as torch reports it (the longest matching key), or None."""
    keys = sorted((k for k in PEAK_BF16_TFLOPS if k in device_name), key=len, reverse=True)
    return PEAK_BF16_TFLOPS[keys[0]] * 1e12 if keys else None


@functools.cache
def device_peak_flops(device: torch.device) -> tuple[float, str]:
    """(dense bf16 FLOP/s of one device, where the figure comes from: "datasheet <name>" or "measured")."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name)
        if peak is not None:
            return peak, f"datasheet {name}"
    if device.type == "cpu":  # a CPU without bf16 instructions runs its bf16 kernels at its fp32 rate or below
        return max(measured_matmul_flops(device), measured_matmul_flops(device, dtype=torch.float32)), "measured"
    return measured_matmul_flops(device), "measured"


def measured_matmul_flops(
    device: torch.device, n: int | None = None, seconds: float = 0.2, dtype: torch.dtype = torch.bfloat16
) -> float:
    """The rate of an n x n x n matmul in `dtype` on `device` (n: 4,096 on a GPU, 1,024 on a CPU), the best of the
    repetitions that fit in about `seconds` after one warm-up."""
    n = n or (4096 if device.type == "cuda" else 1024)
    # constant operands: drawing random ones would move the process's RNG, which a seeded run's draws depend on
    a = torch.full((n, n), 0.5, device=device, dtype=dtype)
    b = torch.full((n, n), 0.25, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: the kernel's choice and the first touch of the output
    _sync(device)
    best, deadline = float("inf"), time.perf_counter() + seconds
    for _ in range(50):
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best


def matmul_parameters(hf: dict) -> int:
    """The parameters each token is multiplied by (see the module doc), from an HF Qwen3 / Qwen3-MoE config."""
    dim, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    head_dim = hf.get("head_dim") or dim // hf["num_attention_heads"]
    q_width, kv_width = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    attention = dim * (q_width + 2 * kv_width) + q_width * dim
    if hf.get("num_experts"):
        mlp = hf["num_experts_per_tok"] * 3 * dim * hf["moe_intermediate_size"] + dim * hf["num_experts"]
    else:
        mlp = 3 * dim * hf["intermediate_size"]
    return layers * (attention + mlp) + vocab * dim


def flops_per_token(hf: dict, seq_len: int) -> float:
    """Training FLOPs (forward and backward) per token of rows `seq_len` long."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    attention_width = hf["num_attention_heads"] * head_dim
    return 6 * matmul_parameters(hf) + 6 * hf["num_hidden_layers"] * seq_len * attention_width


def mfu(hf: dict, tokens: int, seq_len: int, step_s: float, peak_flops: float, devices: int = 1) -> float:
    """The fraction of `devices` x `peak_flops` that `tokens` tokens in rows of `seq_len` used in `step_s`."""
    return flops_per_token(hf, seq_len) * tokens / step_s / (peak_flops * devices)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
