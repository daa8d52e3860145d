"""The GRPO loss family as small pure functions of per-token tensors.

All tensors are [B, T] aligned with `TrainBatch.tokens`; `mask` is the response mask. The importance
ratio is always taken against the behaviour logprobs the generator recorded when it sampled each token,
so stale samples (made by older weights) are corrected, not silently treated as on-policy.

`per_token_loss` gives the loss of every token; `reduce_loss` turns it into a scalar with one of three
normalisations, using *global* counts so that summing the result over micro-batches and data-parallel
ranks gives exactly the loss of the whole batch:
- "sequence_mean": mean over each sequence's tokens, then over sequences (GRPO as published);
- "token_mean": mean over all response tokens of the batch (DAPO);
- "token_sum": sum over tokens divided by a constant, num_sequences * max_response_len (Dr. GRPO),
  so long and short responses are not re-weighted by their length.

`policy_loss` picks the objective (docs/algorithms.md):
- "grpo": PPO's clipped token ratio pi_theta / pi_behaviour;
- "gspo": GSPO's sequence ratio s = exp(mean over the sequence's tokens of log pi_theta - log pi_behaviour),
  clipped as a whole (its clip ranges are ~1e-3, not 0.2); written per token as sg[s] * pi / sg[pi] so that
  with "sequence_mean" the gradient is exactly GSPO's, s * A * mean_t grad log pi;
- "cispo": CISPO's REINFORCE with a clipped, stop-gradient importance weight, -sg[clip(r)] * A * log pi, so
  every token keeps a gradient (PPO's clip zeroes those outside the range).

`is_correction` corrects the train/inference mismatch (docs/algorithms.md): the behaviour policy mu is the
generator's (its numerics, its possibly older version), the trainer's own logprob before the update is pi_old,
and w = pi_old / mu per token (`is_level: token`), its product over the sequence (`sequence`), or the exponential
of the mean of its logs over the sequence (`geometric`, for long responses, whose product drifts):
- "tis": truncated IS, weight min(w, is_high);
- "mis": masked IS, weight w where w <= is_high, else 0 (the token or sequence takes no part);
- "icepop": weight w where is_low <= w <= is_high, else 0 (both sides masked).
The trust region stays: the token's ratio pi / mu is clipped as in plain mode, and only tokens the clip leaves alone
get a gradient, the corrected -w * A * grad log pi (the weight replaces the unbounded ratio in it). Without the clip
a stale token would be bounded only by is_high. `mismatch` measures |log pi_old - log mu| and the k3 estimate of
KL(mu || pi_old) whatever the correction, so drift is visible before it ruins a run.

On-policy distillation uses any of them with a per-token advantage: `distill_coef` * (log pi_teacher -
log pi_behaviour) of each sampled token, plus `reward_coef` * the sequence's reward advantage.

The settings (`LossConfig`, checked when made) are in forge_rl/losses/config.py.
"""

import math

import torch

from forge_rl.losses.config import NORMALIZATIONS, LossConfig


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    return torch.exp(-log_ratio) + log_ratio - 1  # k3 (Schulman): exp(ref - lp) - (ref - lp) - 1


def token_advantages(
    advantages: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    cfg: LossConfig,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's advantage [B, T] (the sequence's [B], or PPO's per-token [B, T], times reward_coef) and, for
    on-policy distillation, minus distill_coef x the reverse KL of the sampling policy to the teacher at that token
    (also returned)."""
    A = (advantages if advantages.dim() == 2 else advantages[:, None]).to(dtype)
    if cfg.distill_coef:
        if ref_logprobs is None:
            raise ValueError("loss.distill_coef > 0 needs TrainBatch.ref_logprobs (the teacher's logprobs)")
        reverse_kl = behaviour_logprobs - ref_logprobs  # log pi_behaviour - log pi_teacher of each sampled token
        return cfg.reward_coef * A - cfg.distill_coef * reverse_kl.to(dtype), reverse_kl
    return (cfg.reward_coef * A if cfg.reward_coef != 1.0 else A), None


def importance_ratio(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cfg: LossConfig, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio the clip acts on, weight outside the clip) per token: against the behaviour policy (plain), a
    sequence-level ratio (gspo); with a correction, the ratio against the behaviour policy and the corrected
    importance weight that takes its place in the gradient."""
    if cfg.policy_loss == "gspo":
        if mask is None:
            raise ValueError("loss.policy_loss='gspo' needs the response mask (a sequence-level ratio)")
        m = mask.to(logprobs.dtype)
        seq_log_ratio = ((logprobs.detach() - behaviour_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1)
        ratio = torch.exp(seq_log_ratio)[:, None] * torch.exp(logprobs - logprobs.detach())  # value s, grad s * dlp
        return ratio, torch.ones_like(logprobs)
    ratio = torch.exp(logprobs - behaviour_logprobs)
    if cfg.is_correction != "none":  # the clip still acts on pi / mu; the weight replaces the ratio's value
        return ratio, mismatch_weight(logprobs, behaviour_logprobs, cfg, mask)[0]
    return ratio, torch.ones_like(logprobs)


def mismatch_weight(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cfg: LossConfig, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight [B, T] of `cfg.is_correction` (no gradient), and where it acted (bool [B, T]):
    w = pi_old / mu per token, or for is_level "sequence" the product over the sequence's response tokens,
    or the geometric mean (the exponential of the mean log weight), truncated (tis) or masked (mis, icepop).
    Computed in log space, so a long sequence's product cannot overflow."""
    log_w = (logprobs.detach() - behaviour_logprobs).to(torch.float32)
    if cfg.is_level != "token":
        if mask is None:
            raise ValueError(f"loss.is_level={cfg.is_level!r} needs the response mask")
        log_w = (log_w * mask).sum(-1, keepdim=True)
        if cfg.is_level == "geometric":
            log_w = log_w / mask.sum(-1, keepdim=True).clamp(min=1)
        log_w = log_w.expand(mask.shape)
    high, low = math.log(cfg.is_high), (math.log(cfg.is_low) if cfg.is_low > 0 else -math.inf)
    acted = log_w > high
    if cfg.is_correction == "icepop":
        acted = acted | (log_w < low)
    weight = torch.exp(log_w.clamp(max=high))
    if cfg.is_correction in ("mis", "icepop"):
        weight = weight * ~acted
    return weight.to(logprobs.dtype), acted


def mismatch(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token train/inference mismatch of the sampled tokens: |log pi_old - log mu| and the k3 estimate of
    KL(mu || pi_old) from mu's samples, r - 1 - log r with r = pi_old / mu (non-negative, unbiased)."""
    log_r = logprobs.detach() - behaviour_logprobs
    return {"mismatch_abs": log_r.abs(), "mismatch_k3": torch.expm1(log_r) - log_r}


def per_token_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of every token [B, T] and per-token diagnostics (not yet masked). `mask` (the response mask) is
    needed by "gspo", whose ratio is a mean over each sequence's tokens.

    Plain mode: ratio = pi_theta / pi_behaviour, clipped to [1 - clip_low, 1 + clip_high] as in PPO.
    Corrected mode (is_correction != "none"): the same clip on pi_theta / pi_behaviour decides which tokens get
    a gradient (the trust region: a stale token the policy has already moved away from in its advantage's
    direction gets none), and those get -w * A * grad log pi, w the weight of `mismatch_weight`, which bounds
    (tis) or removes (mis, icepop) what very mismatched tokens would bring (tested in tests/unit/losses/test_losses.py).
    The trainer takes one optimizer step per batch, so a ratio against the proximal policy pi_old would be 1 and
    could not clip: the clip must be against the behaviour policy.
    """
    A, reverse_kl = token_advantages(advantages, behaviour_logprobs, ref_logprobs, cfg, logprobs.dtype)
    ratio, weight = importance_ratio(logprobs, behaviour_logprobs, cfg, mask)
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    unclipped_obj, clipped_obj = ratio * A, clipped * A
    if cfg.policy_loss == "cispo":  # the clipped weight carries no gradient; log pi always does
        loss = -clipped.detach() * A * logprobs
        was_clipped = (clipped != ratio).float()
    elif cfg.is_correction != "none":  # the tokens the clip leaves alone: -w * A * grad log pi; the others none
        was_clipped = (clipped_obj < unclipped_obj).detach()
        loss = -weight * A * torch.exp(logprobs - logprobs.detach()) * ~was_clipped
        was_clipped = was_clipped.float()
    else:
        loss = -weight * torch.minimum(unclipped_obj, clipped_obj)
        was_clipped = (clipped_obj < unclipped_obj).float()  # the clip bound is what the gradient sees
    diagnostics = {
        "clipped": was_clipped,
        "approx_kl_behaviour": kl_penalty(logprobs.detach(), behaviour_logprobs, "k3"),
        "ratio": torch.exp(logprobs.detach() - behaviour_logprobs),
        **mismatch(logprobs, behaviour_logprobs),
    }
    if cfg.is_correction != "none":  # the weight, and the tokens it truncated (tis) or masked (mis, icepop)
        diagnostics["is_weight"] = weight
        diagnostics["is_corrected"] = mismatch_weight(logprobs, behaviour_logprobs, cfg, mask)[1].float()
    if reverse_kl is not None:
        diagnostics["reverse_kl_teacher"] = reverse_kl
    if cfg.kl_coef:
        if ref_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs TrainBatch.ref_logprobs (run a reference model)")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
        diagnostics["kl_ref"] = kl.detach()
    if entropy is not None:
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy
        diagnostics["entropy"] = entropy.detach()
    return loss, diagnostics


def reduce_loss(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    normalize: str,
    total_sequences: int,
    total_tokens: int,
    max_response_len: int = 0,
) -> torch.Tensor:
    """Scalar loss of these rows, normalised by the whole batch's counts (see the module doc)."""
    mask = mask.to(token_loss.dtype)
    if normalize == "sequence_mean":
        per_seq = (token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / total_sequences
    if normalize == "token_mean":
        return (token_loss * mask).sum() / total_tokens
    if normalize == "token_sum":  # a constant: the batch's longest response would rescale the loss per batch
        if max_response_len < 1:
            raise ValueError(
                "normalize='token_sum' divides by a constant: set trainer.loss.max_response_len (the generation budget)"
            )
        return (token_loss * mask).sum() / (total_sequences * max_response_len)
    raise ValueError(f"normalize={normalize!r}; choose one of {NORMALIZATIONS}")


def sft_token_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the target tokens (negative log-likelihood), per token; reduce with token_mean."""
    return -logprobs
