"""The command line fuzzed from the schema: every leaf key of every app's config (GRPO, PPO, SFT, distill, and the
options its shipped config passes through to vLLM), given a value a user could mistype (a wrong type, 0,
negatives, NaN, infinities, huge numbers, empty and unknown strings, nonexistent paths, malformed YAML). Each case
runs the app up to its first actor, in this process (tests/support/app_checks.py), and must end one of two ways:
accepted, or refused with exit status 2 and one line, `forge_rl: ...`, naming the key. Anything else (a traceback,
a bug's line, a refusal on several lines) fails the case, with the command that reproduces it.

Hypothesis draws the cases, the same ones on every run (derandomized); FORGE_RL_FUZZ_EXAMPLES sets how many (CI
runs the default, a longer run e.g. FORGE_RL_FUZZ_EXAMPLES=3000). The tally is printed at the end."""

import dataclasses
import os
import typing
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO
from tests.support.app_checks import check_in_process

APPS = {
    "grpo": "configs/grpo/tiny.yaml",
    "ppo": "configs/ppo/tiny.yaml",
    "sft": "configs/sft/tiny.yaml",
    "distill": "configs/distill/tiny.yaml",
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


def schema_leaves(schema: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += schema_leaves(tp, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def file_leaves(node, prefix: str = "") -> list[str]:
    """The leaves a shipped config sets, the options it passes through to libraries (generator.sampling.top_p) too."""
    if not isinstance(node, dict):
        return [prefix.rstrip(".")]
    return [key for k, v in node.items() for key in file_leaves(v, f"{prefix}{k}.")]


def leaves(app: str) -> list[str]:
    from tests.support.app_checks import checks_only

    schema, _ = checks_only(app)
    shipped = yaml.safe_load((REPO / APPS[app]).read_text())
    keys = set(schema_leaves(schema)) | set(file_leaves(shipped))
    return sorted(k for k in keys if not k.endswith(OUTPUT_KEYS))


LEAVES = {app: leaves(app) for app in APPS}
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


def case(app: str, key: str, value: str, out: Path) -> list[str]:
    return ["--config", APPS[app], f"{key}={value}", f"output_dir={out}"]


@st.composite
def mistakes(draw):
    app = draw(st.sampled_from(sorted(APPS)))
    return app, draw(st.sampled_from(LEAVES[app])), draw(st.sampled_from(MISTYPED))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mistakes())
def test_a_mistyped_value_is_accepted_or_refused_in_one_line_naming_its_key(in_process, mistake):
    app, key, value = mistake
    out = in_process / f"run{sum(TALLY.values())}"
    argv = case(app, key, value, out)
    checked = check_in_process(app, argv)
    lines = [line for line in checked.stderr.splitlines() if line.strip()]
    command = f"python -m apps.{app}.main {' '.join(argv[:3])}"
    if checked.status == 0:
        TALLY["accepted"] += 1
        return
    TALLY["refused in one line" if checked.status == 2 and len(lines) == 1 else "anything else"] += 1
    assert checked.status == 2, f"{command}: exit {checked.status}, not a user error:\n{checked.stderr[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("forge_rl: "), f"{command}: not one line:\n{checked.stderr}"
    named = key.rsplit(".", 1)[-1]
    assert named in lines[0] or value in lines[0], (
        f"{command}: the line names neither the key nor the value: {lines[0]}"
    )


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
