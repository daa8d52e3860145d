"""DAPO's handling of responses that hit max_tokens: a soft length penalty, and filtering truncated ones.

    overlong:
      penalty_cache_len: 4   # the last 4 tokens before max_tokens are penalised linearly, down to -1
      filter: true           # responses cut off at max_tokens take no part in the loss

Applied by the rollout to each group before its advantages are computed (forge_rl/loop/rollout.py).
"""

from dataclasses import dataclass


@dataclass
class OverlongConfig:
    penalty_cache_len: int = 0  # > 0: DAPO's soft overlong punishment over this many tokens before max_tokens
    filter: bool = False  # truncated responses (finish_reason "length") get advantage 0: no gradient

    def __post_init__(self) -> None:
        if self.penalty_cache_len < 0:
            raise ValueError(f"overlong.penalty_cache_len must be >= 0, got {self.penalty_cache_len}")


def overlong_penalty(length: int, max_tokens: int, cache_len: int) -> float:
    """0 up to max_tokens - cache_len, then falling linearly to -1 at max_tokens (DAPO, eq. 13)."""
    if cache_len <= 0:
        return 0.0
    free = max_tokens - cache_len
    if length <= free:
        return 0.0
    return max(-1.0, (free - length) / cache_len)
