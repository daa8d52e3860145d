"""Reward actor: scores one group per call with several weighted reward functions.

Reward functions use TRL's signature, `reward(prompts, completions, **kwargs) -> list[float]`, and get
`finish_reason` and every column of the task's row (`answer` among them, see forge_rl/data/task.py) as
keyword arguments, one value per completion. They are named in config
either by a short name from `REWARDS` or as "package.module:function", so a user's reward plugs in
without touching forge_rl.

Each call of a reward function runs in a worker process of a small pool (`reward_workers`, default 2 to 4;
forge_rl/rewards/workers.py), so slow ones (a sandbox, a judge) overlap across groups and none can take the
run down. The worker imports the function by its path and binds its `args`. `score` raises a `RewardError`
naming the function, and the caller drops the group, counted under the error's `reason`, and goes on:

    the function raises, returns the wrong number of values, or NaN/inf   RewardError        reward_error
    it runs past reward_timeout_s: its worker is SIGKILLed and replaced    RewardTimeout      reward_timeout
    its worker dies (a segfault, the OOM killer): the worker is replaced   RewardCrash        reward_crash
    it allocates past reward_memory_mb (the worker's RLIMIT_AS)            RewardOutOfMemory  reward_memory
"""

import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.rewards.workers import (DEFAULT_MEMORY_MB, RewardCrash, RewardError,  # noqa: F401 (re-exported)
                                      RewardOutOfMemory, RewardPool, RewardTimeout, default_reward_workers)
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


def reward_target(name: str) -> str:
    """The import path ("package.module:function") a reward's configured name stands for."""
    return REWARDS.get(name, name)


def _import_reward(name: str) -> Callable:
    target = reward_target(name)
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"reward {name!r}: not one of {sorted(REWARDS)} and not 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {name!r}: cannot import {target} ({e})") from None


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
    def __init__(self, specs: list[RewardSpec], timeout_s: float | None = None, workers: int | None = None,
                 memory_mb: int | None = DEFAULT_MEMORY_MB):
        if not specs:
            raise ValueError("rewards: at least one reward function is needed")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward_timeout_s must be > 0 (or null for none), got {timeout_s}")
        self.specs = list(specs)
        for s in self.specs:
            resolve_reward(s.name, s.args)  # a bad name or argument fails at spawn, not mid-run
        self.targets = [reward_target(s.name) for s in self.specs]
        self.timeout_s = timeout_s
        self.pool = RewardPool(workers or default_reward_workers(), memory_mb, preload=sorted(set(self.targets)))

    @endpoint
    async def setup(self) -> None:
        await self.pool.ready()  # the workers' imports (sympy for math) before the first group, not during it

    @concurrent_endpoint  # groups are scored concurrently: one slow verifier does not hold up the others
    async def score(
        self, prompts: list, completions: list[str], finish_reasons: list[str], columns: dict[str, list] | None = None
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Total (weighted) reward per completion, and each function's unweighted values. Every argument holds
        one value per completion; `columns` are the task's columns (`answer` among them), passed to each
        reward function as keyword arguments. Raises a RewardError (see the module) when a function fails."""
        n = len(completions)
        columns = dict(columns or {})
        for name, values in [("prompts", prompts), ("finish_reasons", finish_reasons), *columns.items()]:
            if len(values) != n:
                raise ValueError(f"score: {name} has {len(values)} values for {n} completions")
        parts: dict[str, list[float]] = {}
        for spec, target in zip(self.specs, self.targets):
            parts[spec.name] = await self.pool.score(spec.name, target, spec.args, list(prompts), list(completions),
                                                     self.timeout_s, finish_reason=list(finish_reasons), **columns)
        totals = [sum(s.weight * parts[s.name][i] for s in self.specs) for i in range(n)]
        return totals, parts

    @endpoint
    async def stats(self) -> dict:
        return {"workers": self.pool.workers, "replaced": self.pool.replaced}
