"""Reward actor: scores one group per call with several weighted reward functions.

Reward functions use TRL's signature, `reward(prompts, completions, **kwargs) -> list[float]`, and get
`finish_reason` and every column of the task's row (`answer` among them, see forge_rl/data/task.py) as
keyword arguments, one value per completion. They are named in config
either by a short name from `REWARDS` or as "package.module:function", so a user's reward plugs in
without touching forge_rl.

Reward functions run in threads, so slow ones (a sandbox, a judge) overlap across groups. A function
that raises, returns the wrong number of values, or returns NaN/inf makes `score` raise
`RewardError` naming the function, and one slower than `timeout_s` raises `RewardTimeout`; the caller drops
that group with a counted reason and the run goes on.
"""

import asyncio
import importlib
import inspect
import math
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from monarch.actor import concurrent_endpoint

from forge_rl.runtime import ForgeActor

REWARDS = {
    "exact_match": "forge_rl.rewards.exact_match:exact_match",
    "format": "forge_rl.rewards.format:digits_format",
    "math": "forge_rl.rewards.math:math_answer",
    "math_format": "forge_rl.rewards.math:math_format",
    "code_tests": "forge_rl.rewards.sandbox:code_tests",
}


@dataclass
class RewardSpec:
    name: str  # a key of REWARDS, or "package.module:function"
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments (e.g. a sandbox's limits)


class RewardError(RuntimeError):
    """A reward function failed on a group; the group is dropped (reason "reward_error")."""


def resolve_reward(name: str, args: dict[str, Any] | None = None) -> Callable:
    """The reward function `name` names, with `args` bound as keyword arguments."""
    fn = _import_reward(name)
    if not args:
        return fn
    named = {p.name for p in inspect.signature(fn).parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(args) - named)  # a misspelt limit must not vanish into **kwargs
    if unknown:
        raise ValueError(f"reward {name!r}: args {unknown} do not fit it (its parameters: {sorted(named)})")
    return functools.partial(fn, **args)


def _import_reward(name: str) -> Callable:
    target = REWARDS.get(name, name)
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"reward {name!r}: not one of {sorted(REWARDS)} and not 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {name!r}: cannot import {target} ({e})") from None


class RewardTimeout(RewardError):
    """A reward function took longer than `reward_timeout_s`; the group is dropped (reason "reward_timeout")."""


def check_reward_columns(specs: list[RewardSpec], columns: list[str]) -> None:
    """Every parameter a reward function requires must be a column of the task (or `finish_reason`)."""
    given = set(columns) | {"finish_reason"}
    for spec in specs:
        params = list(inspect.signature(resolve_reward(spec.name, spec.args)).parameters.values())[2:]  # after prompts, completions
        missing = [p.name for p in params if p.default is inspect.Parameter.empty
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in given]
        if missing:
            raise ValueError(f"reward {spec.name!r} needs {missing}, which the task's rows do not have (columns: "
                             f"{sorted(given)}); map them with task.answer_column or add them to the data")


class RewardActor(ForgeActor):
    def __init__(self, specs: list[RewardSpec], timeout_s: float | None = None):
        if not specs:
            raise ValueError("rewards: at least one reward function is needed")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward_timeout_s must be > 0 (or null for none), got {timeout_s}")
        self.specs = list(specs)
        self.functions = [resolve_reward(s.name, s.args) for s in self.specs]  # fail at spawn, not mid-run
        self.timeout_s = timeout_s

    @concurrent_endpoint  # groups are scored concurrently: one slow verifier does not hold up the others
    async def score(
        self, prompts: list, completions: list[str], finish_reasons: list[str], columns: dict[str, list] | None = None
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Total (weighted) reward per completion, and each function's unweighted values. Every argument holds
        one value per completion; `columns` are the task's columns (`answer` among them), passed to each
        reward function as keyword arguments."""
        n = len(completions)
        columns = dict(columns or {})
        for name, values in [("prompts", prompts), ("finish_reasons", finish_reasons), *columns.items()]:
            if len(values) != n:
                raise ValueError(f"score: {name} has {len(values)} values for {n} completions")
        parts: dict[str, list[float]] = {}
        for spec, fn in zip(self.specs, self.functions):
            call = asyncio.to_thread(fn, list(prompts), list(completions), finish_reason=list(finish_reasons), **columns)
            try:
                # A timed-out function's thread runs on (Python cannot stop a thread); its group is dropped.
                values = await asyncio.wait_for(call, self.timeout_s)
            except TimeoutError:
                raise RewardTimeout(f"reward {spec.name!r} took longer than reward_timeout_s={self.timeout_s}") from None
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
