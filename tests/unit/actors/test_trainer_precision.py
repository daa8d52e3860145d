"""The trainer's forward under bf16 mixed precision over fp32 master weights (trainer.dtype=bfloat16 without FSDP2:
autocast), on the embedded tiny model in this process: what dtypes reach the norms and the matmuls.

On a GPU, an fp32 norm weight meeting a bf16 input takes torch's unfused RMSNorm, and an fp32 hidden state reaching
the fused head makes the step's largest matmul an fp32 one: both are checked here, on the CPU, by the dtypes the
trainer's own step code hands them (TrainerStep, with the model, config and flags the Trainer sets up).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.actors.trainer_step import TrainerStep
from forge_rl.models import qwen3, resolve_model_path
from forge_rl.models.qwen3_config import attention_pair_cost

MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


class NormDtypes(TorchFunctionMode):
    """(input dtype, weight dtype) of every rms_norm call, as the norm module hands them to torch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.rms_norm, torch.rms_norm):
            weight = args[2] if len(args) > 2 else (kwargs or {}).get("weight")
            self.seen.append((args[0].dtype, weight.dtype))
        return func(*args, **(kwargs or {}))


class MatmulDtypes(TorchDispatchMode):
    """(operand dtypes, output columns) of every matmul as it runs, after autocast's casts; not the fused head's
    per-row dot product of its fp32 probabilities and logits (the entropy, [n, 1, 1]), an fp32 reduction by design."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in MATMULS and tuple(out.shape[-2:]) != (1, 1):
            operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]
            self.seen.append((tuple(a.dtype for a in operands), out.shape[-1]))
        return out


def trainer_step(dtype: str, share_prompts: bool) -> TrainerStep:
    """The trainer's step code over the tiny model, with what Trainer._build sets for one rank without FSDP."""
    model_dir = resolve_model_path("tiny-warm")
    model, _ = qwen3.build_model(model_dir)  # fp32 master weights
    model._skip_lm_head = True  # the fused head, as the Trainer sets it
    step = TrainerStep()
    step.cfg = TrainerConfig(model=str(model_dir), dtype=dtype, share_prompts=share_prompts)
    step.model, step.device, step.route_replay = model, torch.device("cpu"), None
    step.autocast = dtype != "float32"  # Trainer._build: no FSDP2 mixed-precision policy on one rank
    step.fused_lm_head, step.head_memory_bytes, step.loss_parallel = True, 2**20, False
    step.attention_pair_cost = attention_pair_cost(qwen3.read_hf_config(model_dir))
    return step


def group_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four responses to one 12-token prompt: a group, which shared-prompt packing packs into one row."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 100, (12,), generator=g)
    tokens = torch.cat([prompt.expand(4, 12), torch.randint(3, 100, (4, 20), generator=g)], dim=1)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 12:] = True
    return tokens, mask


@pytest.mark.parametrize("share_prompts", [True, False], ids=["packed", "response-positions"])
def test_bf16_step_runs_every_norm_and_matmul_in_bf16(share_prompts):
    """Every rms_norm meets a weight of its input's dtype (torch's fused kernel applies), and every matmul of the
    forward and backward, the head's over the vocabulary included, runs bf16 x bf16; the logprobs stay fp32."""
    step = trainer_step("bfloat16", share_prompts)
    tokens, mask = group_batch()
    vocab = step.model.lm_head.weight.shape[0]
    with NormDtypes() as norms, MatmulDtypes() as matmuls:
        logprobs, entropy = step._forward(tokens, "grad", mask)
        (logprobs.sum() + entropy.sum()).backward()
    assert norms.seen and all(x == w for x, w in norms.seen), f"norm (input, weight) dtypes: {set(norms.seen)}"
    assert any(cols == vocab for _, cols in matmuls.seen), "the head's matmul over the vocabulary did not run"
    fp32 = {(dtypes, cols) for dtypes, cols in matmuls.seen if dtypes != (torch.bfloat16, torch.bfloat16)}
    assert not fp32, f"matmuls not in bf16 (operand dtypes, output columns): {fp32}"
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert step.model.lm_head.weight.grad.dtype == torch.float32  # the master weight's gradient


def test_bf16_head_logprobs_within_the_stated_bound_of_fp32():
    """The fused head in bf16 against fp32, on the same fp32 hidden states of the tiny model. Stated bound: each
    bf16 logit z carries at most ~3 roundings of 2^-9 relative (hidden, weight, the product's output), and a logprob
    z_t - logsumexp(z) adds two such errors, so |d logprob| <= 2^-6 max|z| on every token, and on average
    <= 2^-8 of each row's max|z| (the roundings are not all of one sign). The fp32 sync bound against the engine
    (< 1e-4) is for fp32 runs and holds unchanged."""
    from forge_rl.losses.fused_head import hidden_logprobs

    model, _ = qwen3.build_model(resolve_model_path("tiny-warm"))
    model._skip_lm_head = True
    tokens, _ = group_batch()
    with torch.no_grad():
        hidden, weight = model(tokens), model.lm_head.weight
        want, _ = hidden_logprobs(hidden, weight, tokens)
        got, _ = hidden_logprobs(hidden, weight, tokens, compute_dtype=torch.bfloat16)
        largest = (hidden @ weight.t()).abs().amax(-1)[:, :-1]  # each predicting position's max |logit|
    diff = (got - want).abs()[:, 1:]
    assert float(diff.max()) > 0  # bf16 did run: the two differ
    assert diff.max() <= 2**-6 * largest.max(), (float(diff.max()), float(largest.max()))
    assert diff.mean() <= 2**-8 * largest.mean(), (float(diff.mean()), float(largest.mean()))
