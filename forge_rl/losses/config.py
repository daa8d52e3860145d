"""The GRPO loss family's settings (`trainer.loss`): the clip range, the normalisation, the policy objective, the
train/inference mismatch correction, the KL penalty and on-policy distillation's coefficients, each checked when the
config is made. The losses themselves, and what each setting does, are in forge_rl/losses/grpo.py; this module imports
no torch, so a run's config is read and checked before any actor starts.
"""

from dataclasses import dataclass

NORMALIZATIONS = ("sequence_mean", "token_mean", "token_sum")
POLICY_LOSSES = ("grpo", "gspo", "cispo")
IS_CORRECTIONS = ("none", "tis", "mis", "icepop")
IS_LEVELS = ("token", "sequence", "geometric")


@dataclass
class LossConfig:
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high; > clip_low is DAPO's clip-higher
    normalize: str = "sequence_mean"  # see NORMALIZATIONS
    # the "token_sum" constant (Dr. GRPO): required with it; the GRPO run sets it to the generation budget
    # (generator.sampling.max_tokens, or env.max_total_tokens for multi-turn) when left at 0
    max_response_len: int = 0
    kl_coef: float = 0.0  # KL penalty to the reference policy (needs TrainBatch.ref_logprobs)
    kl_estimator: str = "k3"  # "k1" (log ratio) | "k3" (unbiased, non-negative)
    # train/inference mismatch correction with w = pi_old / pi_behaviour (forge_rl/losses/grpo.py's module doc)
    is_correction: str = "none"  # see IS_CORRECTIONS
    # "token": w per token; "sequence": the product of the sequence's token weights; "geometric": their geometric mean
    is_level: str = "token"
    is_low: float = 0.5  # icepop: weights below are masked
    is_high: float = 2.0  # tis: the truncation cap; mis, icepop: weights above are masked
    entropy_coef: float = 0.0  # bonus for entropy (subtracted from the loss)
    policy_loss: str = "grpo"  # see POLICY_LOSSES
    # On-policy distillation (apps/distill): every token's advantage gains distill_coef * (log pi_teacher -
    # log pi_behaviour), the negative reverse KL to the teacher per sampled token (teacher logprobs in
    # TrainBatch.ref_logprobs); reward_coef scales the task reward's sequence advantage (0: pure distillation).
    distill_coef: float = 0.0
    reward_coef: float = 1.0

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"loss.policy_loss={self.policy_loss!r}; choose one of {POLICY_LOSSES}")
        if self.is_correction not in IS_CORRECTIONS or self.is_level not in IS_LEVELS:
            raise ValueError(
                f"loss.is_correction={self.is_correction!r}, loss.is_level={self.is_level!r}; choose "
                f"one of {IS_CORRECTIONS} and one of {IS_LEVELS}"
            )
        if self.policy_loss != "grpo" and self.is_correction != "none":
            raise ValueError(
                f"loss.is_correction={self.is_correction!r} works with loss.policy_loss='grpo' only, "
                f"not {self.policy_loss!r} (gspo and cispo carry their own importance ratio)"
            )
        if not 0 <= self.is_low < 1 < self.is_high:
            raise ValueError(
                f"loss.is_low={self.is_low} and loss.is_high={self.is_high} must satisfy 0 <= is_low < 1 < is_high"
            )
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"loss.normalize={self.normalize!r}; choose one of {NORMALIZATIONS}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"loss.kl_estimator={self.kl_estimator!r}; choose 'k1' or 'k3'")
        if self.distill_coef < 0 or self.reward_coef < 0:
            raise ValueError(
                f"loss.distill_coef={self.distill_coef} and loss.reward_coef={self.reward_coef} must be >= 0"
            )
        if self.distill_coef and self.kl_coef:
            raise ValueError(
                "loss.distill_coef and loss.kl_coef both read TrainBatch.ref_logprobs (the teacher, or "
                "the reference policy): use one"
            )
        if not (0 <= self.clip_low <= 1 and self.clip_high >= 0):  # clip_low 1: no floor (CISPO's usual choice)
            raise ValueError(
                f"loss.clip_low={self.clip_low} must be in [0, 1] and loss.clip_high={self.clip_high} >= 0"
            )
