"""Every mistake a user can make ends in one line: the table of bad inputs, each run as a user runs the app
(`python -m apps.grpo.main --config configs/grpo/tiny.yaml key=value ...`) in a subprocess.

Each case must exit with status 2 and no traceback, its error one line on stderr that starts with `forge_rl:` and
names the key or the file. A case checkable before any actor starts must be found there, in seconds: its stderr is
that one line and nothing else. The cases only an actor can find (a bad row deep in a streamed source, an engine
argument vLLM's own validation refuses) end with the same kind of line, after the actors' start-up. The cases run two at a time; the table (case, exit status,
seconds, line) is printed at the end, and docs/getting_started.md shows it to users.
"""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

GRPO = ("grpo", "configs/grpo/tiny.yaml")
SFT = ("sft", "configs/sft/tiny.yaml")
PPO = ("ppo", "configs/ppo/tiny.yaml")
DISTILL = ("distill", "configs/distill/tiny.yaml")
# What a run prints just before it starts its first actor: a case checkable before must never get there.
STARTING_ACTORS = ("starting actors", "starting the trainer")
# A sanity bound, generous for a 2-core machine loaded ten times over (measured up to 69 s there, importing vLLM
# to check an engine argument); 3-15 s each on an idle one, where starting the actors alone takes a minute.
BEFORE_ACTORS_S = 120
WORKERS = 2


@dataclass
class Case:
    name: str
    app: tuple[str, str]  # (app, config file)
    args: list[str]
    names: list[str]  # what the line must name (the key, the file, the fix)
    before_actors: bool = True


def cases(d: Path) -> list[Case]:
    """The table. `d` holds the bad files the cases point at."""
    return [
        Case("config file missing", GRPO, ["--config", f"{d}/nope.yaml"], ["nope.yaml", "not found"]),
        Case("config file not YAML", GRPO, ["--config", f"{d}/bad.yaml"], ["bad.yaml", "not valid YAML"]),
        Case("unknown key", GRPO, ["trainer.optim.lrate=1"], ["trainer.optim.lrate", "did you mean 'trainer.optim.lr'"]),
        Case("unknown key in a list", GRPO, ["rewards=[{nme: exact_match}]"], ["rewards[0].nme", "rewards[0].name"]),
        Case("wrong type", GRPO, ["steps=many"], ["'steps'", "expects int"]),
        Case("steps=0", GRPO, ["steps=0"], ["steps must be >= 1"]),
        Case("batch_groups=0", GRPO, ["batch_groups=0"], ["batch_groups must be >= 1"]),
        Case("group_size=1 (GRPO)", GRPO, ["group_size=1"], ["group_size=1", "group_size >= 2"]),
        Case("max_policy_age=-1", GRPO, ["max_policy_age=-1"], ["max_policy_age must be >= 0"]),
        Case("eval_size=-5", GRPO, ["eval_size=-5"], ["eval_size must be >= 0"]),
        Case("micro_batch_size=-1", GRPO, ["trainer.micro_batch_size=-1"], ["trainer.micro_batch_size must be >= 0"]),
        Case("lr=nan", GRPO, ["trainer.optim.lr=nan"], ["'trainer.optim.lr' is nan"]),
        Case("repetition_penalty", GRPO, ["generator.sampling.repetition_penalty=1.1"],
             ["generator.sampling.repetition_penalty=1.1", "remove it"]),
        Case("top_k over the kept-set cap", GRPO, ["generator.sampling.top_k=100"],
             ["generator.sampling.top_k=100", "generator.max_kept_tokens=64"]),
        Case("max_kept_tokens=0", GRPO, ["generator.max_kept_tokens=0"], ["generator.max_kept_tokens=0"]),
        Case("max_logprobs under the cap", GRPO, ["generator.sampling.top_p=0.9", "generator.engine_args.max_logprobs=8"],
             ["generator.engine_args.max_logprobs=8", "generator.max_kept_tokens"]),
        Case("temperature=0", GRPO, ["generator.sampling.temperature=0"],
             ["generator.sampling.temperature=0", "temperature > 0"]),
        Case("max_tokens=0", GRPO, ["generator.sampling.max_tokens=0"], ["generator.sampling.max_tokens=0"]),
        Case("misspelt engine arg", GRPO, ["generator.engine_args.max_model_length=64"],
             ["generator.engine_args.max_model_length", "did you mean 'max_model_len'"]),
        Case("engine arg of the wrong type", GRPO, ["generator.engine_args.max_model_len=abc"],
             ["generator.engine_args.max_model_len='abc'", "integer >= 1"]),
        Case("engine arg vLLM refuses", GRPO, ["generator.engine_args.dtype=float64"],
             ["generator.engine_args.dtype='float64'", "'float32'"], before_actors=False),
        Case("model path missing", GRPO, [f"model={d}/no_model"], [f"model='{d}/no_model'", "no such directory"]),
        Case("model path not a model", GRPO, ["model=configs"], ["model='configs'", "no config.json"]),
        Case("model without weights", GRPO, [f"model={d}/config_only"], [f"model='{d}/config_only'", "no weights"]),
        Case("data file missing", GRPO, [f"task.source={d}/nope.jsonl"], [f"{d}/nope.jsonl", "no such file"]),
        Case("held-out file without answers", GRPO, [f"task.source={d}/train.jsonl", f"task.held_out={d}/no_answer.jsonl"],
             [f"{d}/no_answer.jsonl:1", "task.answer_column"]),
        Case("every prompt too long", GRPO, [f"task.source={d}/long.jsonl"],
             [f"task.source '{d}/long.jsonl'", "generator.engine_args.max_model_len"]),
        Case("every held-out prompt too long", GRPO, [f"task.source={d}/train.jsonl", f"task.held_out={d}/long.jsonl"],
             [f"task.held_out '{d}/long.jsonl'", "generator.engine_args.max_model_len"]),
        Case("reward not importable", GRPO, ['rewards=[{name: "no_such_module:score"}]'],
             ["reward 'no_such_module:score'", "cannot import"]),
        Case("SFT batch_size=0", SFT, ["batch_size=0"], ["batch_size must be >= 1"]),
        Case("SFT dataset missing", SFT, [f"dataset={d}/nope.jsonl"], [f"{d}/nope.jsonl", "no such file"]),
        Case("SFT misspelt engine arg", SFT, ["engine_args.max_modl_len=64"], ["engine_args.max_modl_len"]),
        Case("PPO group_size=0", PPO, ["group_size=0"], ["group_size must be >= 1"]),
        Case("distill teacher missing", DISTILL, [f"teacher={d}/no_teacher"], [f"teacher='{d}/no_teacher'"]),
        Case("bad row found by an actor", GRPO,
             ["task.source=tests.tasks_for_tests:rows_then_one_without_answer", "eval_size=0", "steps=50",
              "group_size=2", "batch_groups=2", "rollout_tasks=2"],
             ["tests.tasks_for_tests:rows_then_one_without_answer row 64", "task.answer_column"], before_actors=False),
    ]


@dataclass
class Result:
    case: Case
    status: int
    seconds: float
    stderr: str
    stdout: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    @property
    def error(self) -> str:
        return self.lines[-1] if self.lines else ""


def run_case(case: Case, out: Path, extra: tuple[str, ...] = ()) -> Result:
    app, config = case.app
    argv = case.args if case.args and case.args[0] == "--config" else ["--config", config, *case.args]
    env = {k: v for k, v in os.environ.items() if k != "FORGE_RL_DEBUG"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"apps.{app}.main", *argv, f"output_dir={out}", *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return Result(case, proc.returncode, time.perf_counter() - start, proc.stderr, proc.stdout)


def bad_files(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "bad.yaml").write_text("steps: [1, 2\n")
    (d / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                           for i in range(8)))
    (d / "no_answer.jsonl").write_text(json.dumps({"prompt": "1+1="}) + "\n")
    (d / "long.jsonl").write_text("".join(json.dumps({"prompt": "1+" * 200 + "1=", "answer": "201"}) + "\n"
                                          for _ in range(3)))
    (d / "config_only").mkdir(exist_ok=True)
    (d / "config_only" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))


@pytest.fixture(scope="module")
def table(tmp_path_factory, pytestconfig) -> dict[str, Result]:
    d = tmp_path_factory.mktemp("bad_inputs")
    bad_files(d)
    all_cases = cases(d)
    # the slow case first, so the cheap ones run beside it
    ordered = sorted(enumerate(all_cases), key=lambda ic: (ic[1].before_actors, ic[0]))
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda ic: run_case(ic[1], d / f"out{ic[0]}"), ordered))
    by_name = {r.case.name: r for r in results}
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n" + table_text([by_name[c.name] for c in all_cases]), flush=True)  # in the test output, always
    return by_name


def table_text(results: list[Result]) -> str:
    rows = [f"{'case':32} {'exit':>4} {'s':>6}  line"]
    rows += [f"{r.case.name:32} {r.status:>4} {r.seconds:6.1f}  {r.error}" for r in results]
    return "\n".join(rows)


CASE_NAMES = [c.name for c in cases(Path("/d"))]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_mistake_ends_in_one_line_naming_it(table, name):
    r = table[name]
    assert r.status == 2, f"exit status {r.status}; stderr:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.error.startswith("forge_rl: "), r.stderr[-3000:]
    for what in r.case.names:
        assert what in r.error, f"the line does not name {what!r}: {r.error}"
    if r.case.before_actors:
        assert len(r.lines) == 1, f"stderr is more than the one line:\n{r.stderr[-3000:]}"
        assert not any(m in r.stdout for m in STARTING_ACTORS), f"found after actors started:\n{r.stdout[-3000:]}"
        assert r.seconds < BEFORE_ACTORS_S, f"{r.seconds:.1f} s for a check that needs no actor"
    else:  # the case does test the path through an actor
        assert any(m in r.stdout for m in STARTING_ACTORS), r.stdout[-3000:]


def test_max_tokens_0_is_not_blamed_on_a_key_the_user_never_set(table):
    assert "overlong" not in table["max_tokens=0"].error


def test_debug_shows_the_traceback_before_the_same_line(tmp_path):
    """--debug (or FORGE_RL_DEBUG=1): the traceback, then the same one line, the same exit status."""
    case = next(c for c in cases(tmp_path) if c.name == "group_size=1 (GRPO)")
    quiet = run_case(case, tmp_path / "quiet")
    loud = run_case(case, tmp_path / "loud", ("--debug",))
    assert loud.status == quiet.status == 2
    assert "Traceback (most recent call last)" in loud.stderr and "ConfigError" in loud.stderr
    assert loud.error == quiet.error
