"""forge_rl's grouped CPU LoRA ops compute what vLLM's own torch ops compute, for batches of one adapter, several,
and tokens with no adapter (index -1, taken as vLLM takes it), and replace them where vLLM's CPU path calls them."""

import importlib.util

import pytest
import torch

from forge_rl.deps import vllm_cpu_lora

pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")


def vllm_ops():
    """vLLM's torch ops as its source file defines them, whatever was installed in their place in this process."""
    import vllm.lora.ops.torch_ops.lora_ops as installed

    spec = importlib.util.spec_from_file_location("vllm_lora_ops_as_shipped", installed.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("indices", [[0, 0, 0, 0, 0], [2, 0, 1, 2, 0], [1, -1, 1, 0, -1]], ids=["one", "mixed", "none"])
@pytest.mark.parametrize("stacked", [3, 4], ids=["3d", "4d"])
def test_each_op_equals_vllms(indices, stacked):
    torch.manual_seed(0)
    theirs, ours = vllm_ops(), vllm_cpu_lora
    tokens, rank, width, adapters = len(indices), 8, 24, 3
    index = torch.tensor(indices)
    a = torch.randn(adapters, rank, width)
    b = torch.randn(adapters, width, rank)
    if stacked == 4:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    x, h = torch.randn(tokens, width), torch.randn(tokens, rank)

    def both(op, make_out, *args, **kwargs):
        outs = [make_out(), make_out()]
        getattr(theirs, op)(*args[:2], outs[0], *args[2:], **kwargs)
        getattr(ours, op)(*args[:2], outs[1], *args[2:], **kwargs)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)

    start = torch.randn(tokens, width + 4)
    both("bgmv_shrink", lambda: torch.zeros(tokens, rank), x, a, index, scaling=0.5)
    for add in (True, False):
        both("bgmv_expand", start.clone, h, b, index, add_inputs=add)  # output wider than the product (padding)
        both("bgmv_expand_slice", start.clone, h, b, index, 2, width, add_inputs=add)
    both("bgmv_expand", start.clone, h[:1], b, index[:1], add_inputs=True)  # one token's product fills the batch


def test_importing_the_worker_extension_installs_the_ops_where_vllms_cpu_path_calls_them():
    """What vLLM's worker does when it resolves worker_extension_cls: import forge_rl/deps/vllm_worker.py."""
    import forge_rl.deps.vllm_worker as worker
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    shipped = {(m, n): getattr(m, n) for m in (lora_ops, punica_cpu) for n in vllm_cpu_lora.OPS}
    try:
        importlib.reload(worker)
        assert all(getattr(m, n) is vllm_cpu_lora.OPS[n] for m, n in shipped)
    finally:
        for (module, name), op in shipped.items():
            setattr(module, name, op)
