"""GRPO loss family against values worked out by hand on tiny tensors."""

import math

import pytest
import torch

from forge_rl.losses.config import LossConfig
from forge_rl.losses.grpo import kl_penalty, mismatch, mismatch_weight, per_token_loss, reduce_loss, sft_token_loss

LOG2 = math.log(2.0)


def test_ratio_uses_behaviour_logprobs_and_clips_asymmetrically():
    # ratios 2, 1, 0.5 against the behaviour policy; advantages +1 (row 0) and -1 (row 1)
    lp = torch.tensor([[LOG2, 0.0, -LOG2], [LOG2, 0.0, -LOG2]], requires_grad=True)
    behaviour = torch.zeros(2, 3)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    loss, diag = per_token_loss(lp, behaviour, torch.tensor([1.0, -1.0]), cfg)
    # A=+1: -min(r, clip(r)) = -[1.28, 1, 0.5];  A=-1: -min(-r, -clip(r)) = [2, 1, 0.8]
    assert torch.allclose(loss, torch.tensor([[-1.28, -1.0, -0.5], [2.0, 1.0, 0.8]]))
    assert diag["clipped"].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    loss.sum().backward()
    # clipped tokens get no gradient; unclipped ones get -A * ratio
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -1.0, -0.5], [2.0, 1.0, 0.0]]))


def test_never_the_trivial_ratio():
    # the same logprobs with different behaviour logprobs must give different losses
    lp = torch.tensor([[-1.0, -1.0]])
    cfg = LossConfig(clip_low=0.9, clip_high=10.0)
    a, _ = per_token_loss(lp, torch.tensor([[-1.0, -1.0]]), torch.tensor([1.0]), cfg)
    b, _ = per_token_loss(lp, torch.tensor([[-2.0, -2.0]]), torch.tensor([1.0]), cfg)
    assert torch.allclose(a, torch.tensor([[-1.0, -1.0]])) and torch.allclose(b, -torch.full((1, 2), math.e))


def test_truncated_importance_weight():
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-math.log(4.0), -math.log(1.5)]])  # pi/mu = 4 and 1.5
    cfg = LossConfig(is_correction="tis", is_high=2.0, clip_high=10.0)  # a clip wide enough to leave both
    loss, _ = per_token_loss(lp, behaviour, torch.tensor([1.0]), cfg)
    assert torch.allclose(loss, torch.tensor([[-2.0, -1.5]]))  # weight min(4, 2)=2 and 1.5
    loss.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2.0, -1.5]]))


# w = pi_old / mu per token: 4, 1.5, 0.25 (row 0) and 1, 3, 0.8 (row 1); row 1's last token is padding
IS_LP = torch.zeros(2, 3)
IS_BEHAVIOUR = -torch.log(torch.tensor([[4.0, 1.5, 0.25], [1.0, 3.0, 0.8]]))
IS_MASK = torch.tensor([[True, True, True], [True, True, False]])


@pytest.mark.parametrize(
    "correction, level, weights, acted",
    [
        ("tis", "token", [[2.0, 1.5, 0.25], [1.0, 2.0, 0.8]], [[1, 0, 0], [0, 1, 0]]),  # min(w, 2)
        ("mis", "token", [[0.0, 1.5, 0.25], [1.0, 0.0, 0.8]], [[1, 0, 0], [0, 1, 0]]),  # w if w <= 2, else 0
        ("icepop", "token", [[0.0, 1.5, 0.0], [1.0, 0.0, 0.8]], [[1, 0, 1], [0, 1, 0]]),  # w if 0.5 <= w <= 2
        # sequences: row 0's product 4 * 1.5 * 0.25 = 1.5, row 1's (over its 2 response tokens) 1 * 3 = 3
        ("tis", "sequence", [[1.5] * 3, [2.0] * 3], [[0] * 3, [1] * 3]),
        ("mis", "sequence", [[1.5] * 3, [0.0] * 3], [[0] * 3, [1] * 3]),
        ("icepop", "sequence", [[1.5] * 3, [0.0] * 3], [[0] * 3, [1] * 3]),
        # geometric means: row 0's (4 * 1.5 * 0.25)^(1/3) = 1.5^(1/3), row 1's (1 * 3)^(1/2)
        ("tis", "geometric", [[1.5 ** (1 / 3)] * 3, [3**0.5] * 3], [[0] * 3, [0] * 3]),
        ("icepop", "geometric", [[1.5 ** (1 / 3)] * 3, [3**0.5] * 3], [[0] * 3, [0] * 3]),
    ],
)
def test_mismatch_corrections_by_hand(correction, level, weights, acted):
    cfg = LossConfig(is_correction=correction, is_level=level, is_low=0.5, is_high=2.0)
    weight, where = mismatch_weight(IS_LP, IS_BEHAVIOUR, cfg, IS_MASK)
    torch.testing.assert_close(weight, torch.tensor(weights))
    assert where.int().tolist() == acted
    # the gradient is -w * A * grad log pi per token where the plain clip on pi / mu (4, 1.5, 0.25 | 1, 3, 0.8) leaves
    # the token alone: not row 0's 4 and 1.5 (A > 0, above 1 + clip_high); row 1's 3 (A < 0) is left, its weight capped
    lp = IS_LP.clone().requires_grad_()
    A = torch.tensor([1.0, -2.0])
    loss, diag = per_token_loss(lp, IS_BEHAVIOUR, A, cfg, mask=IS_MASK)
    loss.sum().backward()
    kept = torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(lp.grad, -torch.tensor(weights) * A[:, None] * kept)
    assert diag["clipped"].tolist() == (1 - kept).tolist()
    assert diag["is_corrected"].tolist() == [[float(a) for a in row] for row in acted]


def test_sequence_weight_of_a_long_sequence_does_not_overflow():
    behaviour = torch.full((1, 4000), -0.5)  # w = e^0.5 per token: the product is e^2000
    for correction in ("tis", "mis"):
        weight, _ = mismatch_weight(
            torch.zeros(1, 4000),
            behaviour,
            LossConfig(is_correction=correction, is_level="sequence"),
            torch.ones(1, 4000, dtype=torch.bool),
        )
        assert torch.isfinite(weight).all() and weight[0, 0].item() == (2.0 if correction == "tis" else 0.0)


def test_mismatch_is_zero_on_policy_and_measures_the_gap_off_it():
    lp = torch.log(torch.tensor([[0.5, 0.2]]))
    same = mismatch(lp, lp.clone())
    assert same["mismatch_abs"].abs().max() == 0 and same["mismatch_k3"].abs().max() == 0
    gap = mismatch(lp, torch.log(torch.tensor([[0.25, 0.4]])))  # r = pi/mu = 2 and 0.5
    torch.testing.assert_close(gap["mismatch_abs"], torch.tensor([[LOG2, LOG2]]))
    torch.testing.assert_close(gap["mismatch_k3"], torch.tensor([[1 - LOG2, -0.5 + LOG2]]))  # r - 1 - log r
    # k3 is an unbiased estimate of KL(mu || pi) from mu's samples: check on a small distribution
    mu, pi = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.5, 0.3, 0.2])
    k3 = mismatch(torch.log(pi), torch.log(mu))["mismatch_k3"]
    torch.testing.assert_close((mu * k3).sum(), (mu * (mu / pi).log()).sum())


def test_kl_estimators_and_penalty():
    lp, ref = torch.tensor([[0.0]]), torch.tensor([[-LOG2]])
    assert torch.allclose(kl_penalty(lp, ref, "k1"), torch.tensor([[LOG2]]))
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.tensor([[0.5 + LOG2 - 1]]))
    cfg = LossConfig(kl_coef=0.1)
    loss, diag = per_token_loss(lp, lp.clone(), torch.tensor([0.0]), cfg, ref_logprobs=ref)
    assert torch.allclose(loss, 0.1 * torch.tensor([[0.5 + LOG2 - 1]]))
    with pytest.raises(ValueError, match="needs TrainBatch.ref_logprobs"):
        per_token_loss(lp, lp, torch.tensor([0.0]), cfg)


def test_entropy_bonus_lowers_the_loss():
    lp = torch.zeros(1, 2)
    loss, diag = per_token_loss(
        lp, lp, torch.tensor([0.0]), LossConfig(entropy_coef=0.5), entropy=torch.tensor([[1.0, 3.0]])
    )
    assert torch.allclose(loss, torch.tensor([[-0.5, -1.5]]))


def test_normalisations():
    token_loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    # sequence_mean: (mean(1,2,3) + mean(4)) / 2 = (2 + 4) / 2
    assert reduce_loss(token_loss, mask, "sequence_mean", 2, 4).item() == pytest.approx(3.0)
    # token_mean: (1+2+3+4) / 4 tokens
    assert reduce_loss(token_loss, mask, "token_mean", 2, 4).item() == pytest.approx(2.5)
    # token_sum (Dr. GRPO): 10 / (2 sequences * constant 5)
    assert reduce_loss(token_loss, mask, "token_sum", 2, 4, max_response_len=5).item() == pytest.approx(1.0)
    # global counts: the two rows as two micro-batches sum to the whole batch's loss
    for mode in ("sequence_mean", "token_mean", "token_sum"):
        whole = reduce_loss(token_loss, mask, mode, 2, 4, 5)
        parts = sum(reduce_loss(token_loss[i : i + 1], mask[i : i + 1], mode, 2, 4, 5) for i in range(2))
        assert whole.item() == pytest.approx(parts.item())


def test_token_sum_divides_by_a_constant_never_the_batch():
    """Dr. GRPO's normaliser is the generation budget: the same tokens give the same loss whatever else is in
    the batch, and without the constant it is refused (it used to fall back to the batch's longest response)."""
    token_loss = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    short = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    longer = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)  # the second row grew, the first did not
    first_row = [reduce_loss(token_loss[:1], m[:1], "token_sum", 2, 4, max_response_len=8) for m in (short, longer)]
    assert first_row[0].item() == first_row[1].item() == pytest.approx(2 / 16)
    with pytest.raises(ValueError, match="max_response_len"):
        reduce_loss(token_loss, short, "token_sum", 2, 3)


def test_grpo_run_sets_token_sum_constant_to_the_generation_budget():
    from forge_rl.recipes.grpo_checks import check_config, derive_settings
    from forge_rl.recipes.grpo_config import GRPOConfig

    cfg = GRPOConfig()
    cfg.trainer.loss.normalize = "token_sum"
    cfg.generator.sampling["max_tokens"] = 24
    check_config(cfg)
    derive_settings(cfg)
    assert cfg.trainer.loss.max_response_len == 24
    cfg = GRPOConfig()
    cfg.trainer.loss.normalize, cfg.trainer.loss.max_response_len = "token_sum", 100  # the user's own is kept
    check_config(cfg)
    derive_settings(cfg)
    assert cfg.trainer.loss.max_response_len == 100


def test_trainer_refuses_token_sum_without_its_constant():
    from forge_rl.actors.trainer import Trainer
    from forge_rl.actors.trainer_config import TrainerConfig

    with pytest.raises(ValueError, match="trainer.loss.max_response_len"):
        Trainer(TrainerConfig(loss=LossConfig(normalize="token_sum")))


def test_sft_loss_and_config_errors():
    assert torch.equal(sft_token_loss(torch.tensor([[-0.5, -2.0]])), torch.tensor([[0.5, 2.0]]))
    with pytest.raises(ValueError, match="loss.normalize='mean'"):
        LossConfig(normalize="mean")
    with pytest.raises(ValueError, match="loss.kl_estimator"):
        LossConfig(kl_estimator="k2")


# ---- chunked logprobs -------------------------------------------------------------------------------


def naive_token_logprobs(logits, tokens, temperature):
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, tokens[:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    pad = torch.zeros_like(tokens[:, :1], dtype=picked.dtype)
    return torch.cat([pad, picked], 1), torch.cat([pad, entropy], 1)


@pytest.mark.parametrize("block_elements", [1, 2000, 10**7])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_blockwise_logprobs_equal_the_full_log_softmax_with_gradients(block_elements, temperature):
    from forge_rl.losses.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 9, 301, generator=g)).requires_grad_()
    tokens = torch.randint(0, 301, (5, 9), generator=g)
    weights = torch.randn(5, 9, generator=g)
    want_lp, want_ent = naive_token_logprobs(logits, tokens, temperature)
    (want_grad,) = torch.autograd.grad((want_lp * weights).sum() + 0.1 * want_ent.sum(), logits)
    lp, ent = token_logprobs(logits, tokens, temperature, entropy="grad", block_elements=block_elements)
    (grad,) = torch.autograd.grad((lp * weights).sum() + 0.1 * ent.sum(), logits)
    assert (lp - want_lp).abs().max() < 1e-5 and (ent - want_ent).abs().max() < 1e-5
    assert (grad - want_grad).abs().max() < 1e-5
    lp, ent = token_logprobs(logits, tokens, temperature, entropy="detached", block_elements=block_elements)
    assert not ent.requires_grad and lp.requires_grad
    assert token_logprobs(logits, tokens, temperature)[1] is None  # no entropy unless asked for


# one position a block, logits recomputed; two blocks (logits kept at shift 1: 40 positions x 301 x 4 bytes is half
# the budget; recomputed at shift 0: 45 positions); one block, logits kept
@pytest.mark.parametrize("memory_bytes", [1, 8 * 40 * 301, 10**9])
@pytest.mark.parametrize("shift", [1, 0])
def test_fused_lm_head_logprobs_equal_the_full_logits_with_gradients(memory_bytes, shift):
    from forge_rl.losses.fused_head import hidden_logprobs, plan_blocks
    from forge_rl.losses.logprobs import selected_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 9, 16, generator=g).requires_grad_()
    weight = torch.randn(301, 16, generator=g).requires_grad_()
    tokens = torch.randint(0, 301, (5, 9), generator=g)
    weights = torch.randn(5, 9, generator=g)
    logits = hidden @ weight.T
    if shift:
        want_lp, want_ent = naive_token_logprobs(logits, tokens, 0.7)
    else:  # logits at position t predict tokens[t] (packed, already picked)
        lp0, ent0 = selected_logprobs(logits.flatten(0, 1), tokens.flatten(), 0.7, entropy="grad")
        want_lp, want_ent = lp0.view(5, 9), ent0.view(5, 9)
    want = torch.autograd.grad((want_lp * weights).sum() + 0.1 * want_ent.sum(), (hidden, weight))
    lp, ent = hidden_logprobs(hidden, weight, tokens, 0.7, entropy="grad", shift=shift, memory_bytes=memory_bytes)
    got = torch.autograd.grad((lp * weights).sum() + 0.1 * ent.sum(), (hidden, weight))
    positions = 5 * (9 - shift)
    keep, rows = plan_blocks(positions, 301, memory_bytes, compute_bytes=4)
    assert {1: (not keep and rows == 1), 10**9: (keep and rows == positions)}.get(
        memory_bytes, keep == bool(shift) and rows < positions
    )
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


def test_fused_lm_head_runs_its_matmuls_in_the_compute_dtype_and_accumulates_in_fp32():
    """bf16 hidden states (mixed precision): every matmul of the fused head, forward and backward, runs in
    bf16 (on a GPU, the step's largest matmul at tensor-core speed, not fp32's), while the logprobs, entropy
    and the weight's gradient come out in fp32 and match the fp32 computation to bf16's precision."""
    from torch.overrides import TorchFunctionMode

    from forge_rl.losses.fused_head import hidden_logprobs

    class MatmulDtypes(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.mm):
                self.seen.append(tuple(a.dtype for a in args[:2]))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    hidden32, weight32 = torch.randn(3, 7, 32, generator=g), torch.randn(211, 32, generator=g) * 0.2
    tokens = torch.randint(0, 211, (3, 7), generator=g)
    want_lp, want_ent = hidden_logprobs(hidden32, weight32, tokens, 0.8, entropy="detached")
    hidden = hidden32.bfloat16().requires_grad_()
    weight = weight32.bfloat16().requires_grad_()
    with MatmulDtypes() as mode:
        lp, ent = hidden_logprobs(hidden, weight, tokens, 0.8, entropy="detached", memory_bytes=500 * 12)
        lp.sum().backward()
    assert mode.seen and all(dtypes == (torch.bfloat16, torch.bfloat16) for dtypes in mode.seen), mode.seen
    assert lp.dtype == ent.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, want_lp, atol=0.1, rtol=0.02)
    torch.testing.assert_close(ent, want_ent, atol=0.1, rtol=0.02)


def test_tis_keeps_the_plain_clip_as_its_trust_region_and_truncates_the_weight():
    """One optimizer step per batch: a ratio to the proximal policy would be 1 and never clip, leaving stale tokens
    bounded by is_high alone. The clip acts on pi / mu as in plain mode: tokens it clips get no gradient, exactly
    as in plain mode, and the others get the truncated weight min(pi/mu, cap) in place of the ratio."""
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 6, generator=g) * 3).requires_grad_()
    behaviour = lp.detach() + torch.randn(4, 6, generator=g)  # stale: pi/mu far from 1 both ways
    A = torch.randn(4, generator=g)
    clip = dict(clip_low=0.2, clip_high=0.2)
    loss, diag = per_token_loss(lp, behaviour, A, LossConfig(is_correction="tis", is_high=2.0, **clip))
    loss.sum().backward()
    plain_lp = lp.detach().clone().requires_grad_()
    plain, plain_diag = per_token_loss(plain_lp, behaviour, A, LossConfig(**clip))
    plain.sum().backward()
    clipped = diag["clipped"].bool()
    assert torch.equal(clipped, plain_diag["clipped"].bool()) and 0 < clipped.sum() < clipped.numel()
    assert (lp.grad[clipped] == 0).all() and (plain_lp.grad[clipped] == 0).all()
    weight = torch.exp(lp.detach() - behaviour).clamp(max=2.0)
    torch.testing.assert_close(lp.grad[~clipped], (-weight * A[:, None])[~clipped])


def test_gspo_clips_the_sequence_ratio_and_gives_gspos_gradient():
    # row 0: token log-ratios log 2 and 0 (a third, padded token is outside the mask): s = exp(log2 / 2) = 1.414
    # row 1: log-ratios 0.1, -0.1, 0: s = 1
    lp = torch.tensor([[LOG2, 0.0, 5.0], [0.1, -0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    cfg = LossConfig(policy_loss="gspo", clip_low=0.2, clip_high=0.28)
    loss, diag = per_token_loss(lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), cfg, mask=mask)
    # row 0, A=+1: -min(1.414, 1.28) on every token; row 1, A=-1: -min(-1, -1) = 1
    torch.testing.assert_close(loss[mask], torch.tensor([-1.28, -1.28, 1.0, 1.0, 1.0]))
    assert diag["clipped"][0, :2].tolist() == [1.0, 1.0] and diag["clipped"][1].tolist() == [0.0, 0.0, 0.0]
    reduce_loss(loss, mask, "sequence_mean", total_sequences=2, total_tokens=5).backward()
    # clipped sequence: no gradient; the other: s * (-A) * mean over its 3 tokens, / 2 sequences = 1/6 each
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]]))
    with pytest.raises(ValueError, match="needs the response mask"):
        per_token_loss(lp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), cfg)


def test_cispo_keeps_a_gradient_on_every_token_with_a_clipped_stop_gradient_weight():
    lp = torch.tensor([[LOG2, 0.0, -LOG2]], requires_grad=True)  # ratios 2, 1, 0.5
    cfg = LossConfig(policy_loss="cispo", clip_low=0.2, clip_high=0.28)
    loss, diag = per_token_loss(lp, torch.zeros(1, 3), torch.tensor([1.0]), cfg)
    torch.testing.assert_close(loss, torch.tensor([[-1.28 * LOG2, 0.0, 0.8 * LOG2]]))
    assert diag["clipped"].tolist() == [[1.0, 0.0, 1.0]]
    loss.sum().backward()
    # -sg[clip(r)] * A: PPO's clip would give the first and last tokens no gradient
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28, -1.0, -0.8]]))


def test_policy_loss_config_errors_name_the_key():
    with pytest.raises(ValueError, match="loss.policy_loss='ppo2'"):
        LossConfig(policy_loss="ppo2")
    with pytest.raises(ValueError, match="loss.is_correction='tis' works with loss.policy_loss='grpo' only"):
        LossConfig(policy_loss="cispo", is_correction="tis")
    with pytest.raises(ValueError, match="loss.is_correction='seq-tis'"):
        LossConfig(is_correction="seq-tis")
    with pytest.raises(ValueError, match="0 <= is_low < 1 < is_high"):
        LossConfig(is_correction="icepop", is_high=0.9)
    LossConfig(policy_loss="cispo", clip_low=1.0)  # no floor on the weight: allowed
    with pytest.raises(ValueError, match=r"loss.clip_low=1.5 must be in \[0, 1\]"):
        LossConfig(clip_low=1.5)


def test_distillation_advantage_is_minus_the_reverse_kl_to_the_teacher_per_token():
    """A_t = reward_coef * A + distill_coef * (log pi_teacher - log pi_behaviour), per sampled token."""
    behaviour = torch.tensor([[-0.5, -1.0, -2.0]])
    teacher = torch.tensor([[-0.5, -0.2, -3.0]])  # agrees, likes the token more, likes it less
    lp = behaviour.clone().requires_grad_(True)  # on-policy: ratio 1, the clip does not act
    cfg = LossConfig(distill_coef=2.0, reward_coef=0.5)
    loss, diag = per_token_loss(lp, behaviour, torch.tensor([1.0]), cfg, ref_logprobs=teacher)
    advantage = torch.tensor([[0.5 + 0.0, 0.5 + 2 * 0.8, 0.5 - 2 * 1.0]])
    torch.testing.assert_close(loss, -advantage)
    torch.testing.assert_close(diag["reverse_kl_teacher"], behaviour - teacher)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, -advantage)  # d(ratio)/d(lp) = 1 at ratio 1
    # pure distillation: the reward's advantage is left out
    loss, _ = per_token_loss(
        behaviour, behaviour, torch.tensor([5.0]), LossConfig(distill_coef=1.0, reward_coef=0.0), ref_logprobs=teacher
    )
    torch.testing.assert_close(loss, behaviour - teacher)
    with pytest.raises(ValueError, match="needs TrainBatch.ref_logprobs"):
        per_token_loss(behaviour, behaviour, torch.tensor([1.0]), cfg)
    with pytest.raises(ValueError, match="loss.distill_coef and loss.kl_coef"):
        LossConfig(distill_coef=1.0, kl_coef=0.1)
    with pytest.raises(ValueError, match="loss.distill_coef=-1.0"):
        LossConfig(distill_coef=-1.0)


def test_fused_head_forwards_before_their_backwards_keep_their_own_logits():
    """The CPU's kept-logits buffer is reused between calls: a second forward before the first's backward (a
    reference and a policy, two micro-batches) must not write over the logits the first's backward reads."""
    from forge_rl.losses.fused_head import hidden_logprobs

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(301, 16, generator=g).requires_grad_()
    inputs = [
        (torch.randn(3, 7, 16, generator=g).requires_grad_(), torch.randint(0, 301, (3, 7), generator=g))
        for _ in range(2)
    ]
    lps = [hidden_logprobs(h, weight, t, memory_bytes=10**9)[0] for h, t in inputs]
    grads = torch.autograd.grad(sum(lp.sum() for lp in lps), [h for h, _ in inputs] + [weight])
    want_lps = [naive_token_logprobs(h @ weight.T, t, 1.0)[0] for h, t in inputs]
    want = torch.autograd.grad(sum(lp.sum() for lp in want_lps), [h for h, _ in inputs] + [weight])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
