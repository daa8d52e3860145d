"""Reward actor: scores one group per call with several weighted reward functions.

Reward functions use TRL's signature, `reward(prompts, completions, **kwargs) -> list[float]`, and get
`answer` (the target per completion) and `finish_reason` as keyword arguments. They are named in config
either by a short name from `REWARDS` or as "package.module:function", so a user's reward plugs in
without touching forge_rl.

Reward functions run in threads, so slow ones (a sandbox, a judge) overlap across groups. A function
that raises, returns the wrong number of values, or returns NaN/inf makes `score` raise
`RewardError` naming the function; the caller drops that group with a counted reason and the run goes on.
"""

import asyncio
import importlib
import math
from dataclasses import dataclass
from typing import Callable

from monarch.actor import concurrent_endpoint

from forge_rl.controller import ForgeActor

REWARDS = {
    "exact_match": "forge_rl.rewards.exact_match:exact_match",
    "format": "forge_rl.rewards.format:digits_format",
}


@dataclass
class RewardSpec:
    name: str  # a key of REWARDS, or "package.module:function"
    weight: float = 1.0


class RewardError(RuntimeError):
    """A reward function failed on a group; the group is dropped (reason "reward_error")."""


def resolve_reward(name: str) -> Callable:
    target = REWARDS.get(name, name)
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"reward {name!r}: not one of {sorted(REWARDS)} and not 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {name!r}: cannot import {target} ({e})") from None


class RewardActor(ForgeActor):
    def __init__(self, specs: list[RewardSpec]):
        if not specs:
            raise ValueError("rewards: at least one reward function is needed")
        self.specs = list(specs)
        self.functions = [resolve_reward(s.name) for s in self.specs]  # fail at spawn, not mid-run

    @concurrent_endpoint  # groups are scored concurrently: one slow verifier does not hold up the others
    async def score(
        self, prompt: str, completions: list[str], answer: str, finish_reasons: list[str]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Total (weighted) reward per completion, and each function's unweighted values."""
        n = len(completions)
        parts: dict[str, list[float]] = {}
        for spec, fn in zip(self.specs, self.functions):
            try:
                values = await asyncio.to_thread(
                    fn, [prompt] * n, completions, answer=[answer] * n, finish_reason=finish_reasons
                )
            except Exception as e:
                raise RewardError(f"reward {spec.name!r} raised {type(e).__name__}: {e}") from None
            values = [float(v) for v in values]
            if len(values) != n:
                raise RewardError(f"reward {spec.name!r} returned {len(values)} values for {n} completions")
            if not all(math.isfinite(v) for v in values):
                raise RewardError(f"reward {spec.name!r} returned NaN/inf")
            parts[spec.name] = values
        totals = [sum(s.weight * parts[s.name][i] for s in self.specs) for i in range(n)]
        return totals, parts
