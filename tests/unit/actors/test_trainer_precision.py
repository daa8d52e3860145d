"""The trainer's forward under bf16 mixed precision over fp32 master weights (trainer.dtype=bfloat16 without FSDP2:
autocast), on the embedded tiny model in this process: what dtypes reach the norms and the matmuls.

On a GPU, an fp32 norm weight meeting a bf16 input takes torch's unfused RMSNorm, and an fp32 hidden state reaching
the fused head makes the step's largest matmul an fp32 one: both are checked here, on the CPU, by the dtypes the
trainer's own forward hands them (TrainModel, with the model, config and flags build_train_model sets up).
"""

import pytest
import torch

from forge_rl.models import qwen3, resolve_model_path
from tests.support.precision import bf16_step_dtypes, group_batch, trainer_step


@pytest.mark.parametrize("share_prompts", [True, False], ids=["packed", "response-positions"])
def test_bf16_step_runs_every_norm_and_matmul_in_bf16(share_prompts):
    """Every rms_norm meets a weight of its input's dtype (torch's fused kernel applies), and every matmul of the
    forward and backward, the head's over the vocabulary included, runs bf16 x bf16; the logprobs stay fp32."""
    step = trainer_step("bfloat16", share_prompts)
    tokens, mask = group_batch()
    vocab = step.module.lm_head.weight.shape[0]
    norms, matmuls = bf16_step_dtypes(step, tokens, mask)
    assert norms and all(x == w for x, w in norms), f"norm (input, weight) dtypes: {set(norms)}"
    assert any(cols == vocab for _, cols in matmuls), "the head's matmul over the vocabulary did not run"
    fp32 = {(dtypes, cols) for dtypes, cols in matmuls if dtypes != (torch.bfloat16, torch.bfloat16)}
    assert not fp32, f"matmuls not in bf16 (operand dtypes, output columns): {fp32}"
    assert step.module.lm_head.weight.grad.dtype == torch.float32  # the master weight's gradient


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
