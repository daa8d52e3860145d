"""Reward actor: scores one group per call with several weighted reward functions.

Reward functions use TRL's signature, `reward(prompts, completions, **kwargs) -> list[float]`, and get
`finish_reason` and every column of the task's row (`answer` among them, see forge_rl/data/task.py) as
keyword arguments, one value per completion. They are named in config
either by a short name from `REWARDS` or as "package.module:function", so a user's reward plugs in
without touching forge_rl.

Each call of a reward function runs in a worker process of a small pool (`reward_workers`, default 2 to 4;
forge_rl/rewards/workers.py), so slow ones (a sandbox, a judge) overlap across groups and none can take the
run down. The worker imports the function by its path and binds its `args`. `score` raises a `RewardError`
naming the function (its `reward`, and a `sample` of the group's input), and the caller drops the group,
counted under the error's `reason`, and goes on (forge_rl/loop/rollout.py stops the run when a reward fails
on every one of its first groups):

    the function raises, returns the wrong number of values or type, or NaN/inf   RewardError  reward_error
    it runs past reward_timeout_s: its worker is SIGKILLed and replaced    RewardTimeout      reward_timeout
    its worker dies (a segfault, the OOM killer): the worker is replaced   RewardCrash        reward_crash
    it allocates past reward_memory_mb (the worker's RLIMIT_AS)            RewardOutOfMemory  reward_memory

A reward model's actor (or a judge's) that died is no group's failure: `score` raises `RewardRoleDied`
naming it, and the run stops. `score_each_reward` scores every reward on its own, so the held-out
evaluation of one reward survives another's failure (forge_rl/loop/eval.py).
"""

import asyncio
import functools
import importlib
import inspect
import math
import re
import time
from typing import Any
from collections.abc import Callable

from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.deps.monarch import SupervisionError
from forge_rl.errors import RunStopped
from forge_rl.rewards.judge import PARSE_TARGET
from forge_rl.rewards.reward_config import KINDS, RewardConfig
from forge_rl.rewards.workers import (
    DEFAULT_MEMORY_MB,
    RewardCrash,  # noqa: F401 (re-exported)
    RewardError,  # noqa: F401 (re-exported)
    RewardOutOfMemory,  # noqa: F401 (re-exported)
    RewardPool,
    RewardTimeout,
    default_reward_workers,
)
from forge_rl.runtime import ForgeActor
from forge_rl.runtime.faults import why_lost

REWARDS = {
    "exact_match": "forge_rl.rewards.exact_match:exact_match",
    "format": "forge_rl.rewards.format:digits_format",
    "math": "forge_rl.rewards.math:math_answer",
    "math_format": "forge_rl.rewards.math:math_format",
    "code_tests": "forge_rl.rewards.sandbox:code_tests",
}


def reward_model_errors(spec: RewardConfig) -> list[str]:
    """What is wrong with a reward model's settings, each as "key: why" (check_config prefixes rewards[i])."""
    if spec.kind not in KINDS:  # the other settings depend on it
        return [f"kind={spec.kind!r}: the reward model {spec.model!r} has no such kind; choose one of {KINDS}"]
    errors = [
        f"{key}={getattr(spec, key)}: it must be >= 1"
        for key in ("max_batch", "max_concurrency", "max_tokens")
        if getattr(spec, key) < 1
    ]
    if spec.batch_window_ms < 0:
        errors.append(f"batch_window_ms={spec.batch_window_ms}: it must be >= 0")
    if spec.kind == "judge":
        try:
            spec.template.format(prompt="", completion="")
        except (KeyError, IndexError, ValueError) as e:
            errors.append(f"template: only {{prompt}} and {{completion}} can be filled in ({type(e).__name__}: {e})")
        if "{completion}" not in spec.template:
            errors.append("template: it must show the judge the {completion}")
        if not re.fullmatch(r"[\w.]+:\w+", spec.parser):
            try:
                re.compile(spec.parser)
            except re.error as e:
                errors.append(f"parser={spec.parser!r}: not a regex ({e}) nor 'package.module:function'")
    return errors


def resolve_reward(name: str, args: dict[str, Any] | None = None) -> Callable:
    """The reward function `name` names, with `args` bound as keyword arguments."""
    fn = _import_reward(name)
    if not args:
        return fn
    named = {
        p.name for p in inspect.signature(fn).parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
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


def _tokenizer(model: str):
    from forge_rl.deps.transformers import auto_tokenizer
    from forge_rl.models import resolve_model_path

    return auto_tokenizer(resolve_model_path(model))


def judge_context(spec: RewardConfig) -> int:
    """The tokens a judge's engine holds: its engine_args' max_model_len, else its model's positions."""
    from transformers import AutoConfig

    from forge_rl.models import resolve_model_path

    if spec.engine_args.get("max_model_len"):
        return int(spec.engine_args["max_model_len"])
    return int(AutoConfig.from_pretrained(resolve_model_path(spec.model)).max_position_embeddings)


def judge_engine_args(spec: RewardConfig) -> dict[str, Any]:
    """A judge's vLLM engine args: its own `engine_args` on tensor_parallel_size 1 (it gets one GPU)."""
    return {"tensor_parallel_size": 1, **spec.engine_args}


def _left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic()), at least a moment; None for no deadline."""
    return None if deadline is None else max(0.01, deadline - time.monotonic())


def check_reward_columns(specs: list[RewardConfig], columns: list[str]) -> None:
    """Every parameter a reward function requires must be a column of the task (or `finish_reason`). `specs` are
    the run's `rewards`: an error names the entry (`rewards[i].name`, `rewards[i].args`)."""
    given = set(columns) | {"finish_reason"}
    for i, spec in enumerate(specs):
        if spec.model is not None:  # a reward model reads prompts and completions only
            continue
        try:
            _import_reward(spec.name)
        except ValueError as e:
            raise ValueError(f"rewards[{i}].name: {e}") from None
        try:
            fn = resolve_reward(spec.name, spec.args)
        except ValueError as e:
            raise ValueError(f"rewards[{i}].args: {e}") from None
        params = list(inspect.signature(fn).parameters.values())[2:]  # after prompts, completions
        missing = [
            p.name
            for p in params
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in given
        ]
        if missing:
            raise ValueError(
                f"rewards[{i}]: reward {spec.name!r} needs {missing}, which the task's rows do not have (columns: "
                f"{sorted(given)}); map them with task.answer_column or add them to the data"
            )


class RewardUnparsable(RewardError):
    """A judge's verdict held no number its parser could read."""

    reason = "reward_unparsable"


class RewardRoleDied(RunStopped):
    """A reward model's or judge's actor died (its proc was killed, ran out of memory, crashed): the run's
    failure, not a group's."""


SAMPLE_CHARS = 80  # of each field of the sample input a failed reward's error shows


def sample_input(prompts: list, completions: list[str], columns: dict[str, list]) -> str:
    """The first completion of a group and what came with it, for a failed reward's error message."""
    fields = {
        "prompt": prompts[0] if prompts else None,
        "completion": completions[0] if completions else None,
        **{k: v[0] for k, v in columns.items() if v},
    }
    return ", ".join(f"{k}={str(v)[:SAMPLE_CHARS]!r}" for k, v in fields.items())


class RewardActor(ForgeActor):
    def __init__(
        self,
        specs: list[RewardConfig],
        timeout_s: float | None = None,
        workers: int | None = None,
        memory_mb: int | None = DEFAULT_MEMORY_MB,
        models: dict[str, Any] | None = None,
    ):
        """`models`: each reward model spec's name -> its actor (a RewardModel, or a judge's Generator), started by
        the run."""
        if not specs:
            raise ValueError("rewards: at least one reward function is needed")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward_timeout_s must be > 0 (or null for none), got {timeout_s}")
        self.specs = list(specs)
        self.models = dict(models or {})
        for s in self.specs:
            if s.model is None:
                resolve_reward(s.name, s.args)  # a bad name or argument fails at spawn, not mid-run
            elif s.kind not in KINDS:
                raise ValueError(f"rewards: the reward model {s.model!r} has kind={s.kind!r}; choose one of {KINDS}")
            elif s.name not in self.models:
                raise ValueError(f"rewards: the reward model {s.name!r} ({s.model}) has no actor")
        self.targets = [reward_target(s.name) if s.model is None else None for s in self.specs]
        judges = [s for s in self.specs if s.kind == "judge" and s.model]
        self.judge_tokenizers = {s.name: _tokenizer(s.model) for s in judges}
        self.judge_contexts = {s.name: judge_context(s) for s in judges}
        self.timeout_s = timeout_s
        self.gates = {s.name: asyncio.Semaphore(s.max_concurrency) for s in self.specs if s.model is not None}
        functions = sorted({t for t in self.targets if t is not None} | ({PARSE_TARGET} if judges else set()))
        self.pool = RewardPool(workers or default_reward_workers(), memory_mb, preload=functions)

    async def _model_values(self, spec: RewardConfig, prompts: list, completions: list[str]) -> list[float]:
        """A reward model's values, within reward_timeout_s (waiting for a place under max_concurrency included);
        its failures are RewardErrors naming it. The model is given what is left of that time, and drops or
        aborts the request when it runs out: a slot freed by a timeout is a slot the model has freed too."""
        actor = self.models[spec.name]
        deadline = time.monotonic() + self.timeout_s if self.timeout_s is not None else None

        async def call() -> list[float]:
            async with self.gates[spec.name]:  # at most max_concurrency groups in flight to this model
                if spec.kind == "classifier":
                    return await actor.score.call_one(list(prompts), list(completions), timeout_s=_left(deadline))
                return await self._judge(spec, actor, prompts, completions, deadline)

        try:
            values = await asyncio.wait_for(call(), self.timeout_s)
        except TimeoutError:
            raise RewardTimeout(
                f"reward model {spec.name!r} took longer than reward_timeout_s={self.timeout_s}"
            ) from None
        except RewardError:
            raise
        except SupervisionError as e:  # its actor's proc died: no later group can be scored by it either
            why = why_lost(e)[:200]
            raise RewardRoleDied(f"the {spec.kind} reward model {spec.name!r} ({spec.model}) died: {why}") from None
        except Exception as e:  # the model's actor raised (a bad input, out of memory, its deadline)
            failure = getattr(e, "exception", e)
            kind = RewardTimeout if isinstance(failure, TimeoutError) else RewardError
            message = f"reward model {spec.name!r} failed: {type(failure).__name__}: {failure}"
            raise kind(message.splitlines()[0][:300]) from None
        if len(values) != len(completions) or not all(math.isfinite(v) for v in values):
            raise RewardError(f"reward model {spec.name!r} returned {values!r} for {len(completions)} completions")
        return list(values)

    def _judge_prompt(self, spec: RewardConfig, prompt, completion: str) -> str:
        """The judge's user turn for one completion, in its chat template, cut to fit its context with the
        verdict's max_tokens (the completion keeps its end)."""
        from forge_rl.actors.reward_model import as_messages, fit_completion

        tokenizer, context = self.judge_tokenizers[spec.name], self.judge_contexts[spec.name]
        question = " ".join(m["content"] for m in as_messages(prompt) if m["role"] == "user")

        def render(c: str) -> str:
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": spec.template.format(prompt=question, completion=c)}],
                tokenize=False,
                add_generation_prompt=True,
            )

        try:
            return fit_completion(render, completion, tokenizer, context - spec.max_tokens)
        except ValueError as e:
            raise RewardError(f"judge {spec.name!r}: {e} (its template and the prompt)") from None

    async def _judge(
        self, spec: RewardConfig, judge, prompts: list, completions: list[str], deadline: float | None
    ) -> list[float]:
        """The judge's verdicts, then its parser on them in a reward worker (a user's parser cannot stall this
        actor), both within the deadline."""
        texts = [self._judge_prompt(spec, p, c) for p, c in zip(prompts, completions)]

        async def verdict(text: str) -> str:
            return (
                await judge.generate.call_one(
                    text, n=1, temperature=0.0, max_tokens=spec.max_tokens, timeout_s=_left(deadline)
                )
            )[0].text

        verdicts = list(await asyncio.gather(*(verdict(t) for t in texts)))
        try:
            values = await self.pool.call(
                PARSE_TARGET,
                {"parser": spec.parser, "scale": spec.scale},
                list(prompts),
                verdicts,
                timeout_s=_left(deadline),
            )
        except RewardError as e:
            raise type(e)(f"judge {spec.name!r}'s parser {spec.parser!r}: {e}") from None
        for value, text in zip(values, verdicts):
            if not math.isfinite(value):
                raise RewardUnparsable(
                    f"judge {spec.name!r}: no number in its verdict {text[:80]!r} (parser {spec.parser!r})"
                )
        return values

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
        columns = self._checked(prompts, completions, finish_reasons, columns)
        parts: dict[str, list[float]] = {}
        for spec, target in zip(self.specs, self.targets):
            parts[spec.name] = await self._values(spec, target, prompts, completions, finish_reasons, columns)
        totals = [sum(s.weight * parts[s.name][i] for s in self.specs) for i in range(len(completions))]
        return totals, parts

    @concurrent_endpoint
    async def score_each_reward(
        self,
        prompts: list,
        completions: list[str],
        finish_reasons: list[str],
        columns: dict[str, list] | None = None,
        names: list[str] | None = None,
    ) -> dict[str, list[float] | str]:
        """Each reward (of `names`, default all) scored on its own: its values, or its error's message when it
        failed. One reward's failure costs only its own values (the held-out evaluation, forge_rl/loop/eval.py)."""
        columns = self._checked(prompts, completions, finish_reasons, columns)
        out: dict[str, list[float] | str] = {}
        for spec, target in zip(self.specs, self.targets):
            if names is None or spec.name in names:
                try:
                    out[spec.name] = await self._values(spec, target, prompts, completions, finish_reasons, columns)
                except RewardError as e:
                    out[spec.name] = f"{type(e).__name__}: {e}"
        return out

    @staticmethod
    def _checked(
        prompts: list, completions: list[str], finish_reasons: list[str], columns: dict[str, list] | None
    ) -> dict[str, list]:
        n = len(completions)
        columns = dict(columns or {})
        for name, values in [("prompts", prompts), ("finish_reasons", finish_reasons), *columns.items()]:
            if len(values) != n:
                raise ValueError(f"score: {name} has {len(values)} values for {n} completions")
        return columns

    async def _values(
        self,
        spec: RewardConfig,
        target: str | None,
        prompts: list,
        completions: list[str],
        finish_reasons: list[str],
        columns: dict[str, list],
    ) -> list[float]:
        """One reward's values for a group; its RewardError carries the reward's name and a sample input."""
        try:
            if spec.model is not None:
                return await self._model_values(spec, prompts, completions)
            return await self.pool.score(
                spec.name,
                target,
                spec.args,
                list(prompts),
                list(completions),
                self.timeout_s,
                finish_reason=list(finish_reasons),
                **columns,
            )
        except RewardError as e:
            e.reward, e.sample = spec.name, sample_input(prompts, completions, columns)
            raise

    @endpoint
    async def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.specs}

    @endpoint
    async def stats(self) -> dict:
        return {"workers": self.pool.workers, "replaced": self.pool.replaced}
