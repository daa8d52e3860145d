"""A user's mistake ends the app in one line and exit status 2 wherever it was found: in the config, before any actor,
or inside an actor (Monarch's ActorError carries it back), chained or in a group; a stated stop in one line and
status 1; anything else keeps its traceback. The apps themselves: tests/integration/test_bad_inputs.py."""

import errno
import os
import subprocess
import sys
from dataclasses import dataclass

from pathlib import Path

import pytest
from monarch.actor import ActorError

from forge_rl.errors import ConfigError, DataError, RunStopped, one_line, stated_error
from forge_rl.recipes.command_line import run_from_command_line


def test_the_stated_error_is_found_under_every_wrapper():
    bad_row = DataError("rows.jsonl:3: no column 'answer' (task.answer_column)")
    assert stated_error(bad_row) is bad_row
    assert stated_error(ActorError(bad_row)) is bad_row  # raised in an actor
    try:
        try:
            raise ActorError(bad_row)
        except ActorError as e:
            raise RuntimeError("the rollout task failed") from e
    except RuntimeError as chained:
        assert stated_error(chained) is bad_row
    group = ExceptionGroup("tasks", [RuntimeError("other"), ActorError(bad_row)])
    assert stated_error(group) is bad_row
    stopped = RunStopped("the Trainer process died (Killed(sig=9))")
    assert stated_error(RuntimeError("x")) is None
    assert stated_error(ExceptionGroup("tasks", [stopped, bad_row])) is bad_row  # the user's mistake first
    try:
        try:
            raise bad_row
        except DataError:
            raise RuntimeError("a bug in a handler") from None  # context suppressed on purpose
    except RuntimeError as e:
        assert stated_error(e) is None


def test_a_message_becomes_one_line():
    assert one_line(ConfigError("config file x.yaml is not valid YAML: while parsing\n  in 'x.yaml', line 1\n\n")) == (
        "config file x.yaml is not valid YAML: while parsing in 'x.yaml', line 1"
    )


@dataclass
class Tiny:
    steps: int = 1


def _app(error: BaseException):
    async def main(cfg):
        raise error

    return main


@pytest.mark.parametrize(
    "error, status",
    [
        (ActorError(DataError("rows.jsonl:3: no column 'answer'")), 2),
        (ConfigError("steps must be >= 1, got 0"), 2),
        (RunStopped("the Trainer process died"), 1),
    ],
)
def test_the_app_ends_on_one_line_and_its_status(error, status, capsys, monkeypatch):
    monkeypatch.delenv("FORGE_RL_DEBUG", raising=False)
    monkeypatch.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)  # pytest's stay
    with pytest.raises(SystemExit) as end:
        run_from_command_line(Tiny, _app(error), "tiny", [])
    assert end.value.code == status
    err = capsys.readouterr().err
    assert err == f"forge_rl: {stated_error(error)}\n"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_write_a_full_or_read_only_disk_refused_is_one_line_naming_the_path(code, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("FORGE_RL_DEBUG", raising=False)
    monkeypatch.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)
    refused = OSError(code, os.strerror(code), str(tmp_path / "metrics.jsonl"))
    try:  # as a role's write reaches the controller: wrapped and chained
        raise ActorError(refused)
    except ActorError as e:
        wrapped = RuntimeError("the step failed")
        wrapped.__cause__ = e
    with pytest.raises(SystemExit) as end:
        run_from_command_line(Tiny, _app(wrapped), "tiny", [])
    assert end.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "bug" not in err, err
    assert err.startswith("forge_rl: the run stopped: its output could not be written (") and "resume=true" in err
    assert f"{tmp_path}/metrics.jsonl" in err
    assert ("read-only file system" if code == errno.EROFS else " MiB free (No space left on device)") in err


def test_debug_adds_the_traceback_and_a_bug_keeps_it(capsys, monkeypatch):
    monkeypatch.setenv("FORGE_RL_DEBUG", "1")
    monkeypatch.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)
    with pytest.raises(SystemExit) as end:
        run_from_command_line(Tiny, _app(ConfigError("steps must be >= 1, got 0")), "tiny", [])
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("forge_rl: steps must be >= 1, got 0\n")
    monkeypatch.delenv("FORGE_RL_DEBUG")
    with pytest.raises(SystemExit) as end:  # a config error on the command line: status 2, one line
        run_from_command_line(Tiny, _app(RuntimeError()), "tiny", ["stepz=3"])
    assert end.value.code == 2
    assert (
        capsys.readouterr().err
        == "forge_rl: unknown config key 'stepz' in command-line override 'stepz=3'; did you mean 'steps'?\n"
    )


def test_a_bug_is_one_line_naming_it_and_the_file_its_traceback_went_to(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("FORGE_RL_DEBUG", raising=False)
    monkeypatch.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    from forge_rl.data.arithmetic import problems

    async def main(cfg):  # a bug inside forge_rl, as an actor reports it: wrapped in Monarch's ActorError
        try:
            problems(1, seed=0, max_operand="x")  # randint(0, "x") raises TypeError inside forge_rl
        except TypeError as e:
            raise ActorError(e) from None

    with pytest.raises(SystemExit) as end:
        run_from_command_line(Tiny, main, "tiny", [])
    assert end.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("forge_rl: an unexpected TypeError in forge_rl/data/arithmetic.py:"), err
    assert "a bug in forge_rl" in err and "report it" in err
    log = Path(err.split("its traceback is in ")[1].split(";")[0])
    assert log.parent == tmp_path and "Traceback" in log.read_text() and "arithmetic.py" in log.read_text()


@pytest.mark.parametrize(
    "body, status, stdout, stderr",
    [
        ("print('ran', flush=False)", 0, "ran\n", ""),  # printed output is flushed before the process ends
        ("raise ConfigError('steps must be >= 1, got 0')", 2, "", "forge_rl: steps must be >= 1, got 0\n"),
        ("return {'interrupted': True}", 130, "", ""),
    ],
)
def test_an_apps_process_ends_with_the_runs_status_and_its_output_flushed(body, status, stdout, stderr):
    """`main_process` ends the app's process at once (os._exit, no interpreter teardown): with the status and the
    output `run_from_command_line` gives."""
    script = (
        "from dataclasses import dataclass\n"
        "from forge_rl.errors import ConfigError\n"
        "from forge_rl.recipes.command_line import main_process\n"
        "@dataclass\nclass Tiny:\n    steps: int = 1\n"
        f"async def main(cfg):\n    {body}\n"
        "main_process(Tiny, main, 'tiny', [])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (status, stdout, stderr)
