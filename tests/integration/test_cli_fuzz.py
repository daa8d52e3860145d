"""The command line fuzzed from the schema: every leaf key of every app's config (GRPO, PPO, SFT, distill, and the
options its shipped config passes through to vLLM), the fields of each entry of its lists too (`rewards[0].weight`:
reward functions and reward models, an environment's tools, an OpenEnv environment's arguments), given a value a
user could mistype (a wrong type, 0, negatives, NaN, infinities, huge numbers, empty and unknown strings,
nonexistent paths, malformed YAML). Each case runs the app up to its first actor, in this process
(tests/support/app_checks.py), and must end one of two ways: accepted, or refused with exit status 2 and one line,
`forge_rl: ...`, naming the key; a value of the wrong type, with the key's whole path and the type it expects.
Anything else (a traceback, a bug's line, a refusal on several lines) fails the case, with the command that
reproduces it.

Hypothesis draws the cases, the same ones on every run (derandomized); FORGE_RL_FUZZ_EXAMPLES sets how many (CI
runs the default, a longer run e.g. FORGE_RL_FUZZ_EXAMPLES=3000). The tally is printed at the end."""

import dataclasses
import os
import re
import types
import typing
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from tests.conftest import REPO
from tests.support.app_checks import check_in_process
from tests.support.wrong_types import WRONG

APPS = {
    "grpo": "configs/grpo/tiny.yaml",
    "ppo": "configs/ppo/tiny.yaml",
    "sft": "configs/sft/tiny.yaml",
    "distill": "configs/distill/tiny.yaml",
}
# what a case starts from: an app, its config file and the overrides that complete it. Beside the apps' tiny configs:
# a reward model among the rewards, an OpenEnv environment (its section and its class's arguments) and the tools
# environment (its list of tools)
BASES = {
    **{app: (app, path, []) for app, path in APPS.items()},
    "grpo-rm": ("grpo", "configs/grpo/tiny_rm.yaml", []),
    "grpo-openenv": ("grpo", "configs/grpo/tiny_openenv.yaml", []),
    "grpo-tools": ("grpo", "configs/grpo/tiny.yaml", ["env.name=tools", "env.args={tools: [calculator]}"]),
}
EXAMPLES = int(os.environ.get("FORGE_RL_FUZZ_EXAMPLES", "120"))
MISTYPED = [
    "abc",
    "''",
    "0",
    "-1",
    "-0.5",
    "nan",
    "inf",
    "-inf",
    "1e30",
    "99999999999",
    "1.5",
    "true",
    "null",
    "[1, 2",
    "{a: 1",
    "[]",
    "{}",
    "/nonexistent/path",
    "a.b:c",
]
# keys whose value is where the run writes: an accepted path there is created, which is not a mistake
OUTPUT_KEYS = ("output_dir", "export_dir", "checkpoint_dir", "profile_dir", "log_dir", "state_file", "root")


def schema_leaves(schema: type, values: dict, prefix: str = "") -> list[str]:
    """The schema's keys, and those of the sections and list entries the loaded config has (`values`, its dict):
    the fields of env.openenv where it is set, of each of its rewards (rewards[0].weight, rewards[1].weight, ...)."""
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        tp, key, value = optional(hints[f.name]), prefix + f.name, values.get(f.name)
        item = (typing.get_args(tp) or [None])[0]
        keys.append(key)
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            keys += schema_leaves(tp, value, f"{key}.")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(item):
            for i, entry in enumerate(value or []):
                keys += schema_leaves(item, entry, f"{key}[{i}].")
    return keys


def optional(tp):
    """`X | None` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def config_leaves(node, prefix: str = "") -> list[str]:
    """The leaves a loaded config holds: the options it passes through to libraries (generator.sampling.top_p) and
    each entry of its lists (env.args.tools[0], env.openenv.args.credit[1]) too."""
    if isinstance(node, dict) and node:
        return [key for k, v in node.items() for key in config_leaves(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(node, list) and node:
        return [prefix] + [key for i, v in enumerate(node) for key in config_leaves(v, f"{prefix}[{i}]")]
    return [prefix]


def loaded(base: str):
    """The base's schema and its config as loaded (the file and the base's overrides)."""
    from forge_rl.config import load_config
    from tests.support.app_checks import checks_only

    app, path, overrides = BASES[base]
    schema, _ = checks_only(app)
    return schema, load_config(schema, REPO / path, overrides)


def leaves(base: str) -> list[str]:
    schema, cfg = loaded(base)
    values = dataclasses.asdict(cfg)
    keys = set(schema_leaves(schema, values)) | set(config_leaves(values))
    return sorted(k for k in keys if not k.endswith(OUTPUT_KEYS))


LEAVES = {base: leaves(base) for base in BASES}
TALLY: Counter = Counter()


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FORGE_RL_DEBUG", raising=False)
        mp.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
        mp.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)  # pytest's handlers stay
        mp.chdir(REPO)
        yield tmp_path_factory.mktemp("fuzz")
    print(f"\ncommand-line fuzz: {sum(TALLY.values())} cases: {dict(TALLY)}", flush=True)


def case(base: str, key: str, value: str, out: Path) -> list[str]:
    _, path, overrides = BASES[base]
    return ["--config", path, *overrides, f"{key}={value}", f"output_dir={out}"]


def refused_in_one_line(base: str, argv: list[str], key: str, value: str) -> str | None:
    """Runs the case; None when it was accepted, else its one line, checked: exit status 2, `forge_rl: ...`, naming
    the key or the value; a type error names the key's whole path (`rewards[0].weight`, not `weight`) and a type."""
    checked = check_in_process(BASES[base][0], argv)
    lines = [line for line in checked.stderr.splitlines() if line.strip()]
    command = f"python -m apps.{BASES[base][0]}.main {' '.join(argv[:-1])}"
    if checked.status == 0:
        return None
    assert checked.status == 2, f"{command}: exit {checked.status}, not a user error:\n{checked.stderr[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("forge_rl: "), f"{command}: not one line:\n{checked.stderr}"
    named = key.rsplit(".", 1)[-1]
    read = as_read(value)
    assert named in lines[0] or value in lines[0] or (read and read in lines[0]), (
        f"{command}: the line names neither the key nor the value: {lines[0]}"
    )
    assert "'?'" not in lines[0] and "expects ?" not in lines[0], f"{command}: a key or type left unnamed: {lines[0]}"
    said = re.match(r"forge_rl: config key '([^']+)' in command-line override .* expects (.+?), got ", lines[0])
    if said is not None and said[1] != key:  # a type error names the key given, or a key under it
        assert said[1].startswith((f"{key}.", f"{key}[")), f"{command}: the line names another key: {lines[0]}"
    return lines[0]


def as_read(value: str) -> str:
    """The value as the config reads it, as a line may quote it: true -> True, 1e30 -> 1e+30."""
    try:
        return str(OmegaConf.from_dotlist([f"key={value}"])["key"])
    except Exception:  # noqa: BLE001 - malformed YAML: the line quotes the override as given
        return value


@st.composite
def mistakes(draw):
    base = draw(st.sampled_from(sorted(BASES)))
    return base, draw(st.sampled_from(LEAVES[base])), draw(st.sampled_from(MISTYPED))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mistakes())
def test_a_mistyped_value_is_accepted_or_refused_in_one_line_naming_its_key(in_process, mistake):
    base, key, value = mistake
    out = in_process / f"run{sum(TALLY.values())}"
    try:
        line = refused_in_one_line(base, case(base, key, value, out), key, value)
    except AssertionError:
        TALLY["anything else"] += 1
        raise
    TALLY["accepted" if line is None else "refused in one line"] += 1


def entry_fields(schema: type, cfg, prefix: str = "") -> list[tuple[str, type]]:
    """(key, type) of each field of each entry of the config's lists of sections: ("rewards[0].weight", float)."""
    hints, fields = typing.get_type_hints(schema), []
    for f in dataclasses.fields(schema):
        tp, value = optional(hints[f.name]), getattr(cfg, f.name, None)
        item = (typing.get_args(tp) or [None])[0]
        if dataclasses.is_dataclass(tp):
            fields += entry_fields(tp, value, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(item):
            item_hints = typing.get_type_hints(item)
            for i, g in ((i, g) for i in range(len(value or [])) for g in dataclasses.fields(item)):
                fields.append((f"{prefix}{f.name}[{i}].{g.name}", optional(item_hints[g.name])))
    return fields


# SFT's reward, and GRPO's reward model beside two reward functions (configs/grpo/tiny_rm.yaml)
ENTRY_FIELDS = [
    (base, key, *WRONG[typing.get_origin(tp) or tp])
    for base in ("sft", "grpo-rm")
    for key, tp in entry_fields(*loaded(base))
    if (typing.get_origin(tp) or tp) in WRONG
]


@pytest.mark.parametrize("base, key, value, expects", ENTRY_FIELDS, ids=[f"{c[0]}:{c[1]}" for c in ENTRY_FIELDS])
def test_a_list_entry_field_of_the_wrong_type_is_refused_naming_its_path_and_type(
    in_process, base, key, value, expects
):
    """`rewards[0].weight=abc`: one line naming the whole path and the type expected, never just `weight` or `?`."""
    line = refused_in_one_line(base, case(base, key, value, in_process / f"entry-{base}-{key}"), key, value)
    assert line is not None, f"{key}={value} was accepted"
    assert line.startswith(
        f"forge_rl: config key '{key}' in command-line override '{key}={value}' expects {expects}, got "
    ), line


# what a 1,500-case run found ending otherwise (a bug's line, or a line naming neither key nor value), now refused
FOUND = [
    ("distill", "env.args", "[]"),
    ("sft", "task.few_shot", "{}"),
    ("grpo", "task.columns", "[]"),
    ("distill", "rewards", "{}"),
    ("ppo", "trainer.lora.targets", "{}"),
    ("ppo", "trainer.profile_steps", "{}"),
    ("distill", "task.held_out", "1e30"),
    ("distill", "task.held_out", "true"),
]


@pytest.mark.parametrize("app, key, value", FOUND)
def test_what_the_long_fuzz_found_is_refused_in_one_line_naming_its_key(in_process, app, key, value):
    checked = check_in_process(app, case(app, key, value, in_process / f"found-{app}-{key}-{value}"))
    lines = [line for line in checked.stderr.splitlines() if line.strip()]
    assert checked.status == 2 and len(lines) == 1, checked.stderr
    assert lines[0].startswith("forge_rl: ") and key in lines[0], lines[0]
