"""A judge's verdicts as numbers. This runs in a reward worker (forge_rl/rewards/workers.py), under
reward_timeout_s: a user's parser ("package.module:function") or a pathological regex cannot stall the reward
actor's event loop.

    verdict_scores(prompts, ["Score: 7", "no idea"], parser=r"(\\d+)", scale=0.1)   # [0.7, nan]
"""

import math
import re

from forge_rl.rewards.workers import import_function

PARSE_TARGET = "forge_rl.rewards.judge:verdict_scores"


def judge_score(text: str, parser: str, scale: float) -> float | None:
    """The judge's verdict as a number (times `scale`), or None when `parser` finds none."""
    if re.fullmatch(r"[\w.]+:\w+", parser):  # "package.module:function"
        value = import_function(parser)(text)
    else:
        match = re.search(parser, text)
        value = match.group(1) if match and match.groups() else (match.group(0) if match else None)
    try:
        number = float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
    return number * scale if number is not None and math.isfinite(number) else None


def verdict_scores(prompts: list, verdicts: list[str], parser: str, scale: float) -> list[float]:
    """Each verdict's number times `scale`; NaN where `parser` finds none (the caller names it unparsable).
    TRL's signature, so the reward pool runs it like any reward function."""
    values = [judge_score(v, parser, scale) for v in verdicts]
    return [math.nan if v is None else v for v in values]
