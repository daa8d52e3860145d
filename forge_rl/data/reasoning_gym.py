"""reasoning-gym tasks as a task source: `task.source: reasoning_gym:NAME`, the task's train and held-out rows.

    task:
      source: reasoning_gym:basic_arithmetic   # or reasoning_gym:composite (config: {datasets: [...]})
      split_seed: 0                             # the one seed both splits come from
      reasoning_gym:
        config: {min_terms: 2, max_terms: 2}    # the task's own config keys, as reasoning-gym names them
        prompt_template: "{question}"           # a format string of the item's fields, or "package.module:function"
        held_out_size: 500
        train_size: 5000

A reasoning-gym item depends on its seed plus its index (item k of seed s+1 is item k+1 of seed s), so splitting
by seed would put held-out questions into training. Both splits are index ranges of one seed instead: the
held-out set is the first `held_out_size` distinct questions from index 0, the training set the next
`train_size` distinct ones after them, skipping every question (or prompt) already taken. No held-out question is
ever trained on.

Each row carries what the scorer needs (forge_rl/rewards/reasoning_gym.py): `entry`, the item as the generator
made it, and `dataset`, which task and config made it (for a composite, the task the item came from). Mistakes
(the package missing, an unknown task or config key, a config the task refuses, a template naming a field the
item does not have) are `DataError`s of one line, raised while the rows are made: before any engine starts.
"""

import dataclasses
import importlib
import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forge_rl.data.sources import REASONING_GYM_PREFIX
from forge_rl.errors import DataError, did_you_mean

EXTRA = "pip install 'forge_rl[envs]'"
COMPOSITE = "composite"
SPEC_KEYS = ("name", "weight", "config")  # one task of a composite: reasoning-gym's DatasetSpec
SET_BY_FORGE = ("seed", "size")  # a task's config keys the splits decide
FUNCTION = re.compile(r"[\w.]+:\w+")  # "package.module:function"


@dataclass
class ReasoningGymConfig:
    """`task.reasoning_gym`: how a `reasoning_gym:NAME` source makes its rows (ignored for other sources)."""

    config: dict[str, Any] = field(default_factory=dict)  # the task's config keys; composite: {datasets: [...]}
    prompt_template: str = "{question}"  # fields: question, every metadata key, metadata; or "module:function"
    held_out_size: int = 500  # distinct held-out questions: the first ones of the seed
    train_size: int = 5000  # distinct training questions after them (none of them held out)

    def __post_init__(self) -> None:
        if self.train_size < 1:
            raise ValueError(f"task.reasoning_gym.train_size must be >= 1, got {self.train_size}")
        if self.held_out_size < 0:
            raise ValueError(f"task.reasoning_gym.held_out_size must be >= 0, got {self.held_out_size}")


def task_name(source: str) -> str:
    return source.removeprefix(REASONING_GYM_PREFIX)


def reasoning_gym_splits(
    source: str, rg: ReasoningGymConfig, seed: int
) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """The (train, held-out) rows of `source` ("reasoning_gym:NAME"): index ranges of `seed`, duplicates removed."""
    name = task_name(source)
    registry = _registry(source)
    specs = _checked_specs(name, rg.config, registry)
    wanted = rg.held_out_size + rg.train_size
    limit = 10 * wanted + 1000  # indices looked at before the task is judged to have too few distinct questions
    dataset = _dataset(name, rg.config, specs, seed, limit)
    render = prompt_renderer(rg.prompt_template)
    if name == COMPOSITE:  # each task of a composite has the seed the composite gives it
        scorer_of = {sub: _scorer_spec(sub, config, seed + i + 1, limit) for i, (sub, config) in enumerate(specs)}
    else:
        scorer_of = {name: _scorer_spec(name, rg.config, seed, limit)}
    items = _distinct_items(source, dataset, render, wanted, limit)
    if len(items) < wanted:
        raise DataError(
            f"task.source {source!r}: task.reasoning_gym.config gives only {len(items)} distinct questions in the "
            f"first {limit} items of seed {seed}; wanted held_out_size + train_size = {wanted}: lower "
            "task.reasoning_gym.train_size or widen the config"
        )
    rows = []
    for index, item, prompt in items:
        task = item["metadata"].get("source_dataset", name) if name == COMPOSITE else name
        answer = "" if item["answer"] is None else str(item["answer"])  # None: the scorer judges each answer
        row = {"id": f"{name}-{seed}-{index}", "prompt": prompt, "answer": answer, "entry": item}
        row["dataset"] = scorer_of[task]
        rows.append((f"{source} item {index} of seed {seed}", row))
    return rows[rg.held_out_size :], rows[: rg.held_out_size]


def _registry(source: str) -> dict:
    """reasoning-gym's tasks: name -> (dataset class, config class)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise DataError(f"task.source {source}: needs the optional extra: {EXTRA}") from None
    return DATASETS


def _checked_specs(name: str, config: dict, registry: dict) -> list[tuple[str, dict]]:
    """The tasks `config` makes, as (name, config) each, checked against their config classes."""
    _check_task(name, registry, "task.source reasoning_gym:")
    _check_keys(name, config, registry, "task.reasoning_gym.config")
    if name != COMPOSITE:
        return [(name, config)]
    datasets = config.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise DataError(
            "task.reasoning_gym.config.datasets: a composite needs a list of tasks, each {name, weight, config}"
        )
    specs = []
    for i, spec in enumerate(datasets):
        key = f"task.reasoning_gym.config.datasets[{i}]"
        if not isinstance(spec, dict) or "name" not in spec or set(spec) - set(SPEC_KEYS):
            raise DataError(f"{key}: must be {{name, weight, config}} (config optional), got {spec!r:.120}")
        weight, sub = spec.get("weight", 1.0), spec.get("config") or {}
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise DataError(f"{key}.weight={weight!r}: must be a number > 0")
        _check_task(spec["name"], registry, f"{key}.name=")
        if spec["name"] == COMPOSITE:
            raise DataError(f"{key}.name: a composite cannot hold a composite; list its tasks here")
        _check_keys(spec["name"], sub, registry, f"{key}.config")
        specs.append((spec["name"], sub))
    names = [n for n, _ in specs]
    if len(set(names)) < len(names):
        raise DataError(f"task.reasoning_gym.config.datasets: each task at most once, got {names}")
    return specs


def _check_task(name: str, registry: dict, key: str) -> None:
    if name in registry:
        return
    hint = did_you_mean(name, registry) or f"it has {len(registry)} tasks, e.g. {sorted(registry)[:5]}"
    raise DataError(f"{key}{name}: reasoning-gym has no task {name!r}; {hint}")


def _check_keys(name: str, config: Any, registry: dict, key: str) -> None:
    """Every key of `config` must be a field of the task's config class; seed and size are the splits' own."""
    if not isinstance(config, dict):
        raise DataError(f"{key}: must be a mapping of {name}'s config keys, got {config!r:.80}")
    valid = [f.name for f in dataclasses.fields(registry[name][1]) if f.name not in SET_BY_FORGE]
    for k in config:
        if k in SET_BY_FORGE:
            raise DataError(
                f"{key}.{k}: set by forge_rl: task.split_seed is the one seed both splits come from, "
                "task.reasoning_gym.train_size and held_out_size their sizes"
            )
        if k not in valid:
            close = did_you_mean(k, valid)
            raise DataError(
                f"{key}.{k}: {name} has no config key {k!r}; {close + ' ' if close else ''}its keys: {valid}"
            )


def _dataset(name: str, config: dict, specs: list[tuple[str, dict]], seed: int, size: int):
    """The generator, made by reasoning-gym (its own validation refusing what it refuses)."""
    from reasoning_gym import create_dataset
    from reasoning_gym.composite import DatasetSpec

    kwargs = dict(config)
    if name == COMPOSITE:
        weights = [float(spec.get("weight", 1.0)) for spec in config["datasets"]]
        kwargs["datasets"] = [DatasetSpec(sub, w, dict(cfg)) for (sub, cfg), w in zip(specs, weights, strict=True)]
    try:
        return create_dataset(name, seed=seed, size=size, **kwargs)
    except (AssertionError, TypeError, ValueError, KeyError) as e:
        raise DataError(f"task.reasoning_gym.config: {name} refuses it ({type(e).__name__}: {e})") from None


def _scorer_spec(name: str, config: dict, seed: int, size: int) -> str:
    """What the scorer rebuilds the task from, in a reward worker: its name and config (JSON, one per task)."""
    return json.dumps({"name": name, "config": {**config, "seed": seed, "size": size}}, sort_keys=True)


def _distinct_items(source: str, dataset, render: Callable[[dict], str], wanted: int, limit: int) -> list:
    """(index, item, prompt) of the first `wanted` items whose question and prompt are both new, from index 0."""
    seen: set[str] = set()
    out = []
    for index in range(limit):
        if len(out) == wanted:
            break
        try:
            item = dataset[index]
        except Exception as e:  # a generator's own failure on this config
            raise DataError(f"{source}: item {index} could not be made ({type(e).__name__}: {e})") from None
        prompt = render(item)
        if item["question"] in seen or prompt in seen:
            continue
        seen.update((item["question"], prompt))
        out.append((index, item, prompt))
    return out


def prompt_renderer(template: str) -> Callable[[dict], str]:
    """The item -> prompt function `template` stands for: "package.module:function" (called with the item), or a
    format string of the item's fields (question, each metadata key, metadata). The answer is not a field."""
    key = f"task.reasoning_gym.prompt_template {template!r}"
    if FUNCTION.fullmatch(template):
        module, _, attr = template.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise DataError(f"{key}: cannot import it ({e})") from None
        return lambda item: _checked_prompt(fn(item), key)
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise DataError(f"{key}: not a format string ({e})") from None
    if any(re.split(r"[.\[]", f)[0] == "answer" for f in fields):
        raise DataError(f"{key}: a prompt may not show the answer; use {{question}} or the item's metadata")

    def render(item: dict) -> str:
        values = {**item["metadata"], "question": item["question"], "metadata": item["metadata"]}
        try:
            return _checked_prompt(template.format(**values), key)
        except (KeyError, IndexError, AttributeError) as e:
            raise DataError(f"{key}: the item has no field {e}; its fields: {sorted(values)}") from None

    return render


def _checked_prompt(prompt: Any, key: str) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{key}: gave {prompt!r:.80}; a prompt must be a non-empty string")
    return prompt


def equation_prompt(item: dict) -> str:
    """An arithmetic item as `12+34=`: its expression without spaces, then "=" (the form the tiny models answer).
    For tasks whose items carry metadata `expression` (basic_arithmetic, chain_sum, ...)."""
    expression = item["metadata"].get("expression")
    if not isinstance(expression, str):
        raise DataError(
            f"task.reasoning_gym.prompt_template forge_rl.data.reasoning_gym:equation_prompt: the item has no "
            f"metadata 'expression' (its metadata: {sorted(item['metadata'])}); use a format string instead"
        )
    return expression.replace(" ", "") + "="
