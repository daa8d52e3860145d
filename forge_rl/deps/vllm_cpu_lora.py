"""LoRA on vLLM 0.32's CPU engine, one matrix product per adapter in the batch instead of one per token.

vLLM's CPU punica wrapper (vllm/lora/punica_wrapper/punica_cpu.py) computes every LoRA shrink and expand with its
torch ops (vllm.lora.ops.torch_ops.lora_ops: `bgmv_shrink`, `bgmv_expand`, `bgmv_expand_slice`, and the `sgmv_*`
that call them): each gathers a copy of its adapter's [out, in] matrix per token (`weights[indices]`) and contracts
token by token (`einsum("bi, boi -> bo")`). A prefill of a few thousand tokens copies the adapter a few thousand
times in every LoRA layer, and the engine spends most of its time there. The functions here take the same arguments
and compute the same products (each token times its own adapter, the index taken as vLLM takes it), grouping the
tokens by adapter: one matmul per adapter present, usually one or two.

`install()` puts them in place of vLLM's, in the module vLLM's ops call them from and in the CPU punica wrapper's
namespace. It runs in vLLM's CPU worker, imported with forge_rl's worker extension (forge_rl/deps/vllm_worker.py).
"""

import torch


def per_adapter_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype) -> torch.Tensor:
    """Row t of `inputs` ([T, in]) times adapter `indices[t]`'s matrix of `weights` ([adapters, (1,) out, in]),
    transposed: [T, out] in `dtype`."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    adapters = torch.unique(indices).tolist()
    if len(adapters) == 1:
        return inputs @ weights[adapters[0]].to(dtype).T
    out = inputs.new_empty((inputs.shape[0], weights.shape[-2]))
    for adapter in adapters:
        rows = indices == adapter
        out[rows] = inputs[rows] @ weights[adapter].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = per_adapter_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = per_adapter_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # as vLLM's: one output row broadcast when a single token's product fills a batch; padding widths may differ
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    width = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += outputs[:limit, :width]
    else:
        output_tensor[:, :width] = outputs[:limit, :width]


def bgmv_expand_slice(
    inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int, slice_size: int, add_inputs=True
):
    outputs = per_adapter_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


OPS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def install() -> None:
    """These ops in place of vLLM's torch ops, wherever its CPU LoRA path looks them up."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        for name, op in OPS.items():
            setattr(module, name, op)
