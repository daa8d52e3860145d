"""Every mistake a user can make ends in one line: the table of bad inputs, each given as a user gives it
(`python -m apps.grpo.main --config configs/grpo/tiny.yaml key=value ...`).

Each case must exit with status 2 and no traceback, its error one line on stderr that starts with `forge_rl:` and
names the key or the file. A case checkable before any actor starts must be found there, in seconds: its stderr is
that one line and nothing else. Those run in this process through the apps' own command line
(forge_rl/recipes/command_line.py: parse, load the config, the run's `prepare()`, which is everything a run does
before its first actor), where reaching the end of `prepare()` fails the case. The cases only an actor can find
(a bad row deep in a streamed source, an engine argument vLLM's own validation refuses) and a few of the others
(`as_the_app`) run as the apps in a subprocess, for the real exit status and stderr; those run two at a time. The
table (case, exit status, seconds, line) is printed at the end, and docs/getting_started.md shows it to users.
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
from tests.support.app_checks import check_in_process

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
    as_the_app: bool = False  # also run as the app in a subprocess (always so when an actor finds it)

    @property
    def in_a_subprocess(self) -> bool:
        return self.as_the_app or not self.before_actors


def cases(d: Path) -> list[Case]:
    """The table. `d` holds the bad files the cases point at."""
    return [
        Case("config file missing", GRPO, ["--config", f"{d}/nope.yaml"], ["nope.yaml", "not found"], as_the_app=True),
        Case("config file not YAML", GRPO, ["--config", f"{d}/bad.yaml"], ["bad.yaml", "not valid YAML"]),
        Case(
            "unknown key", GRPO, ["trainer.optim.lrate=1"], ["trainer.optim.lrate", "did you mean 'trainer.optim.lr'"]
        ),
        Case("unknown key in a list", GRPO, ["rewards=[{nme: exact_match}]"], ["rewards[0].nme", "rewards[0].name"]),
        Case("wrong type", GRPO, ["steps=many"], ["'steps'", "expects int"]),
        Case("steps=0", GRPO, ["steps=0"], ["steps must be >= 1"]),
        Case("batch_groups=0", GRPO, ["batch_groups=0"], ["batch_groups must be >= 1"]),
        Case("group_size=1 (GRPO)", GRPO, ["group_size=1"], ["group_size=1", "group_size >= 2"], as_the_app=True),
        Case("max_policy_age=-1", GRPO, ["max_policy_age=-1"], ["max_policy_age must be >= 0"]),
        Case("eval_size=-5", GRPO, ["eval_size=-5"], ["eval_size must be >= 0"]),
        Case("micro_batch_size=-1", GRPO, ["trainer.micro_batch_size=-1"], ["trainer.micro_batch_size must be >= 0"]),
        Case("lr=nan", GRPO, ["trainer.optim.lr=nan"], ["'trainer.optim.lr' is nan"]),
        Case(
            "repetition_penalty",
            GRPO,
            ["generator.sampling.repetition_penalty=1.1"],
            ["generator.sampling.repetition_penalty=1.1", "remove it"],
        ),
        Case(
            "top_k over the kept-set cap",
            GRPO,
            ["generator.sampling.top_k=100"],
            ["generator.sampling.top_k=100", "generator.max_kept_tokens=64"],
        ),
        Case("max_kept_tokens=0", GRPO, ["generator.max_kept_tokens=0"], ["generator.max_kept_tokens=0"]),
        Case(
            "max_logprobs under the cap",
            GRPO,
            ["generator.sampling.top_p=0.9", "generator.engine_args.max_logprobs=8"],
            ["generator.engine_args.max_logprobs=8", "generator.max_kept_tokens"],
        ),
        Case(
            "temperature=0",
            GRPO,
            ["generator.sampling.temperature=0"],
            ["generator.sampling.temperature=0", "temperature > 0"],
        ),
        Case("max_tokens=0", GRPO, ["generator.sampling.max_tokens=0"], ["generator.sampling.max_tokens=0"]),
        Case(
            "misspelt engine arg",
            GRPO,
            ["generator.engine_args.max_model_length=64"],
            ["generator.engine_args.max_model_length", "did you mean 'max_model_len'"],
        ),
        Case(
            "engine arg of the wrong type",
            GRPO,
            ["generator.engine_args.max_model_len=abc"],
            ["generator.engine_args.max_model_len='abc'", "integer >= 1"],
        ),
        Case(
            "engine arg vLLM refuses",
            GRPO,
            ["generator.engine_args.dtype=float64"],
            ["generator.engine_args.dtype='float64'", "'float32'"],
            before_actors=False,
        ),
        Case("model path missing", GRPO, [f"model={d}/no_model"], [f"model='{d}/no_model'", "no such directory"]),
        Case("model path not a model", GRPO, ["model=configs"], ["model='configs'", "no config.json"]),
        Case("model without weights", GRPO, [f"model={d}/config_only"], [f"model='{d}/config_only'", "no weights"]),
        Case("data file missing", GRPO, [f"task.source={d}/nope.jsonl"], [f"{d}/nope.jsonl", "no such file"]),
        Case(
            "held-out file without answers",
            GRPO,
            [f"task.source={d}/train.jsonl", f"task.held_out={d}/no_answer.jsonl"],
            [f"{d}/no_answer.jsonl:1", "task.answer_column"],
        ),
        Case(
            "every prompt too long",
            GRPO,
            [f"task.source={d}/long.jsonl"],
            [f"task.source '{d}/long.jsonl'", "generator.engine_args.max_model_len"],
        ),
        Case(
            "every held-out prompt too long",
            GRPO,
            [f"task.source={d}/train.jsonl", f"task.held_out={d}/long.jsonl"],
            [f"task.held_out '{d}/long.jsonl'", "generator.engine_args.max_model_len"],
        ),
        Case(
            "reward not importable",
            GRPO,
            ['rewards=[{name: "no_such_module:score"}]'],
            ["reward 'no_such_module:score'", "cannot import"],
        ),
        Case(
            "keep_routing on a dense model",
            GRPO,
            ["trainer.keep_routing=true"],
            ["trainer.keep_routing=true", "tiny-warm is dense", "set trainer.keep_routing=false"],
        ),
        Case("SFT batch_size=0", SFT, ["batch_size=0"], ["batch_size must be >= 1"]),
        Case("SFT keep_routing", SFT, ["trainer.keep_routing=true"], ["trainer.keep_routing=true", "remove it"]),
        Case(
            "SFT dataset missing",
            SFT,
            [f"dataset={d}/nope.jsonl"],
            [f"{d}/nope.jsonl", "no such file"],
            as_the_app=True,
        ),
        Case(
            "SFT misspelt engine arg",
            SFT,
            ["generator.engine_args.max_modl_len=64"],
            ["generator.engine_args.max_modl_len"],
        ),
        Case("PPO group_size=0", PPO, ["group_size=0"], ["group_size must be >= 1"]),
        Case("distill teacher missing", DISTILL, [f"teacher={d}/no_teacher"], [f"teacher='{d}/no_teacher'"]),
        Case(
            "bad row found by an actor",
            GRPO,
            # 16 prompts a step and 16 in flight, so that the rollouts reach row 64 within the first steps
            [
                "task.source=tests.support.tasks_for_tests:rows_then_one_without_answer",
                "eval_size=0",
                "steps=50",
                "group_size=2",
                "batch_groups=16",
                "rollout_tasks=16",
            ],
            ["tests.support.tasks_for_tests:rows_then_one_without_answer row 64", "task.answer_column"],
            before_actors=False,
        ),
    ]


@dataclass
class Result:
    case: Case
    how: str  # "as the app" (a subprocess) or "in process"
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


def argv(case: Case, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    config = [] if case.args and case.args[0] == "--config" else ["--config", case.app[1]]
    return [*config, *case.args, f"output_dir={out}", *extra]


def run_case(case: Case, out: Path, extra: tuple[str, ...] = ()) -> Result:
    env = {k: v for k, v in os.environ.items() if k != "FORGE_RL_DEBUG"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", f"apps.{case.app[0]}.main", *argv(case, out, extra)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return Result(case, "as the app", proc.returncode, time.perf_counter() - start, proc.stderr, proc.stdout)


def run_in_process(case: Case, out: Path) -> Result:
    """The case through the apps' own command line (parse, config, checks, the one line and the exit status) in
    this process: status 0 and "starting actors" on stdout where every check passed."""
    c = check_in_process(case.app[0], argv(case, out))
    return Result(case, "in process", c.status, c.seconds, c.stderr, c.stdout)


def bad_files(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "bad.yaml").write_text("steps: [1, 2\n")
    (d / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    (d / "no_answer.jsonl").write_text(json.dumps({"prompt": "1+1="}) + "\n")
    (d / "long.jsonl").write_text(
        "".join(json.dumps({"prompt": "1+" * 200 + "1=", "answer": "201"}) + "\n" for _ in range(3))
    )
    (d / "config_only").mkdir(exist_ok=True)
    (d / "config_only" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))


@pytest.fixture(scope="module")
def table(tmp_path_factory, pytestconfig) -> dict[str, list[Result]]:
    d = tmp_path_factory.mktemp("bad_inputs")
    bad_files(d)
    all_cases = cases(d)
    # the subprocesses first (the slow cases, which start actors, at the head of the queue); the in-process cases
    # run here meanwhile
    apps = sorted(
        (ic for ic in enumerate(all_cases) if ic[1].in_a_subprocess), key=lambda ic: (ic[1].before_actors, ic[0])
    )
    by_name: dict[str, list[Result]] = {c.name: [] for c in all_cases}
    with ThreadPoolExecutor(WORKERS) as pool:
        running = [pool.submit(run_case, c, d / f"app{i}") for i, c in apps]
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("FORGE_RL_DEBUG", raising=False)
            mp.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))  # the app's setdefault
            mp.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)  # pytest's handlers stay
            mp.chdir(REPO)  # the cases' paths are the user's, relative to the repository
            for i, c in enumerate(all_cases):
                if c.before_actors:
                    by_name[c.name].append(run_in_process(c, d / f"in{i}"))
        for future in running:
            r = future.result()
            by_name[r.case.name].append(r)
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n" + table_text([r for c in all_cases for r in by_name[c.name]]), flush=True)  # always shown
    return by_name


def table_text(results: list[Result]) -> str:
    rows = [f"{'case':32} {'run':10} {'exit':>4} {'s':>6}  line"]
    rows += [f"{r.case.name:32} {r.how:10} {r.status:>4} {r.seconds:6.1f}  {r.error}" for r in results]
    return "\n".join(rows)


CASE_NAMES = [c.name for c in cases(Path("/d"))]


def test_the_table_runs_every_case_once_in_process_or_as_the_app_and_some_both(table):
    hows = {name: sorted(r.how for r in results) for name, results in table.items()}
    assert all(hows.values()), hows
    assert sum(h == ["as the app", "in process"] for h in hows.values()) >= 3, hows  # the real exit status too


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_mistake_ends_in_one_line_naming_it(table, name):
    for r in table[name]:
        where = f"{r.how}: "
        assert r.status == 2, f"{where}exit status {r.status}; stderr:\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr, where + r.stderr[-3000:]
        assert r.error.startswith("forge_rl: "), where + r.stderr[-3000:]
        for what in r.case.names:
            assert what in r.error, f"{where}the line does not name {what!r}: {r.error}"
        if r.case.before_actors:
            assert len(r.lines) == 1, f"{where}stderr is more than the one line:\n{r.stderr[-3000:]}"
            assert not any(m in r.stdout for m in STARTING_ACTORS), (
                f"{where}found after actors started:\n{r.stdout[-3000:]}"
            )
            assert r.seconds < BEFORE_ACTORS_S, f"{where}{r.seconds:.1f} s for a check that needs no actor"
        else:  # the case does test the path through an actor
            assert any(m in r.stdout for m in STARTING_ACTORS), where + r.stdout[-3000:]


def test_max_tokens_0_is_not_blamed_on_a_key_the_user_never_set(table):
    assert all("overlong" not in r.error for r in table["max_tokens=0"])


def test_debug_shows_the_traceback_before_the_same_line(table, tmp_path):
    """--debug (or FORGE_RL_DEBUG=1): the traceback, then the same one line, the same exit status."""
    (quiet,) = [r for r in table["group_size=1 (GRPO)"] if r.how == "as the app"]
    loud = run_case(quiet.case, tmp_path / "loud", ("--debug",))
    assert loud.status == quiet.status == 2
    assert "Traceback (most recent call last)" in loud.stderr and "ConfigError" in loud.stderr
    assert loud.error == quiet.error


@pytest.mark.parametrize("app", ["grpo", "ppo", "distill", "sft"])
def test_a_config_the_schema_refuses_ends_before_torch_is_imported(app):
    """The apps import their recipe (torch, TorchTitan: seconds of CPU) only once the config is read: a typo in
    a key or a malformed override costs a user well under a second."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", f"apps.{app}.main", "--config", f"configs/{app}/tiny.yaml"]
        + ["no_such_key=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    assert out.returncode == 2 and "torch" not in imported and "forge_rl.config" in imported, out.stderr[-2000:]
    errors = [line for line in lines if not line.startswith("import time:")]
    assert len(errors) == 1 and errors[0].startswith("forge_rl: ") and "no_such_key" in errors[0], errors
