"""A run owns its output folder and its checkpoints: the run id in run.json, a second run refused or replacing the
first (overwrite=true), retention by run, checksums that catch a damaged checkpoint and a resume that passes over
it, and the command line's one line and exit status for each output-folder and resume mistake. The checkpoints
here are written by a fault-injecting stand-in for the trainer (files as DCP writes them); the real trainer's
run the same code in tests/integration/test_run_ownership.py."""

import asyncio
import contextlib
import json
import hashlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from forge_rl.loop.checkpoint import commit_checkpoint, complete_checkpoints, newest_intact
from forge_rl.runtime.manifest import MANIFEST, verify
from forge_rl.loop.run_folder import RUN_FILE, RunFinished, RunFolderError, claim_output_dir
from tests.conftest import REPO

TINY = REPO / "configs/grpo/tiny.yaml"


def write_checkpoint(checkpoint_dir: Path, step: int, run_id: str, keep_last: int = 0) -> Path:
    async def write(partial: Path) -> None:  # as DCP and save_checkpoint lay a checkpoint out
        partial.mkdir(parents=True)
        (partial / "__0_0.distcp").write_bytes(os.urandom(64 << 10))
        (partial / ".metadata").write_bytes(f"step {step}".encode())
        (partial / "app_state.pt").write_bytes(os.urandom(2000))

    return asyncio.run(commit_checkpoint(checkpoint_dir, step, run_id, write, keep_last))


def claim(out: Path, **kw):
    args = dict(algorithm="grpo", resume=False, overwrite=False, steps=10, export_dir=str(out / "hf")) | kw
    return claim_output_dir(out, out / "checkpoints", **args)


def finished_run(out: Path, steps=(5, 10)) -> str:
    """A run's folder as a finished run leaves it: run.json, checkpoints, metrics, summary, an export, a
    profiler trace (trainer.profile_steps)."""
    run_id = claim(out).run_id
    for step in steps:
        write_checkpoint(out / "checkpoints", step, run_id)
    (out / "metrics.jsonl").write_text('{"step": 10, "eval/accuracy": 0.8}\n')
    (out / "summary.json").write_text('{"steps": 10}\n')
    (out / "hf").mkdir()
    (out / "hf/config.json").write_text("{}")
    (out / "profile").mkdir()
    (out / "profile/rank0_step3.json.gz").write_bytes(b"\x1f\x8b")
    return run_id


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root by its content's hash: two snapshots compare exactly, and a failed comparison names the
    files that differ instead of printing their bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def garble(path: Path, offset: int = 4096, size: int = 4096) -> None:
    """4 KB of garbage inside the file, its size unchanged (a bad sector, a torn copy)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(os.urandom(size))


def test_a_second_run_in_a_folder_is_refused_and_the_first_run_left_as_it_was(tmp_path):
    run_id = finished_run(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(RunFolderError) as refused:
        claim(tmp_path)
    message = str(refused.value)
    assert "\n" not in message and f"output_dir {tmp_path}" in message and run_id in message
    assert "step-10" in message and "resume=auto" in message and "overwrite=true" in message
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_the_earlier_run_and_records_a_new_id(tmp_path):
    old = finished_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")  # not a run's file: kept
    new = claim(tmp_path, overwrite=True)
    assert new.run_id != old and new.resume_from is None and "replaced" in new.notes[0]
    assert json.loads((tmp_path / RUN_FILE).read_text())["id"] == new.run_id
    assert not list((tmp_path / "checkpoints").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["checkpoints", "notes.txt", RUN_FILE])


def test_retention_deletes_only_this_runs_checkpoints(tmp_path):
    for step in (10, 20, 30):
        write_checkpoint(tmp_path, step, "old-run")
    for step in (5, 12, 15, 40):
        write_checkpoint(tmp_path, step, "new-run", keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path, "old-run")] == ["step-10", "step-20", "step-30"]
    assert [p.name for p in complete_checkpoints(tmp_path, "new-run")] == ["step-15", "step-40"]


def test_checksums_catch_garbage_a_missing_file_and_a_damaged_app_state(tmp_path):
    for step in (1, 2, 3, 4, 5):
        write_checkpoint(tmp_path, step, "r")
    assert verify(tmp_path / "step-1") is None
    garble(tmp_path / "step-5/__0_0.distcp")
    (tmp_path / "step-4/__0_0.distcp").unlink()
    garble(tmp_path / "step-3/app_state.pt", offset=100, size=64)
    (tmp_path / "step-2" / MANIFEST).write_text("{not json")
    path, skipped = newest_intact(tmp_path, "r")
    assert path.name == "step-1"
    assert skipped == [
        "step-5: checksum mismatch in __0_0.distcp",
        "step-4: missing __0_0.distcp",
        "step-3: checksum mismatch in app_state.pt",
        f"step-2: {MANIFEST} unreadable (written only in part, or by a forge_rl without checkpoint checksums)",
    ]


def test_resume_takes_the_newest_intact_checkpoint_of_the_run_and_names_what_it_passed_over(tmp_path):
    run_id = finished_run(tmp_path)
    write_checkpoint(tmp_path / "checkpoints", 7, "another-run")  # someone else's: never resumed, never named
    garble(tmp_path / "checkpoints/step-10/__0_0.distcp")
    resumed = claim(tmp_path, resume="auto", steps=20)
    assert resumed.run_id == run_id and resumed.resume_from.name == "step-5" and resumed.resume_step == 5
    assert resumed.notes == ["resume: passed over step-10: checksum mismatch in __0_0.distcp; resuming from step-5"]
    assert json.loads((tmp_path / RUN_FILE).read_text())["resumes"][0]["step"] == 5


def test_a_run_stopped_between_its_last_checkpoint_and_its_summary_is_finished_by_the_resume(tmp_path):
    """Killed during finish(), after the checkpoint at `steps` and before summary.json (the last thing it writes):
    the resume continues from that checkpoint to do the rest (evaluation, export, summary), not RunFinished."""
    run_id = finished_run(tmp_path)
    (tmp_path / "summary.json").unlink()
    resumed = claim(tmp_path, resume="auto", steps=10)
    assert resumed.run_id == run_id and resumed.resume_from.name == "step-10" and resumed.resume_step == 10
    assert resumed.notes == [
        f"resume: run {run_id} stopped after its last step (step-10) before it finished: finishing it"
    ]
    for unfinished in ('{"steps": 10, "interrupted": true}', '{"steps": 5}', "{not json"):  # stopped, or an older end
        (tmp_path / "summary.json").write_text(unfinished)
        assert claim(tmp_path, resume=True, steps=10).resume_from.name == "step-10", unfinished
    (tmp_path / "summary.json").write_text('{"steps": 10}')
    with pytest.raises(RunFinished):
        claim(tmp_path, resume="auto", steps=10)


def test_resume_mistakes_are_found_before_anything_starts(tmp_path):
    with pytest.raises(RunFolderError, match="resume=true: no intact checkpoint of a run .* resume=false"):
        claim(tmp_path, resume=True)
    finished_run(tmp_path / "done")
    with pytest.raises(RunFinished, match="is complete: its checkpoint .*step-10 is at steps=10"):
        claim(tmp_path / "done", resume="auto", steps=10)
    with pytest.raises(RunFolderError, match="steps=8 is below .*step 10.*set steps above 10"):
        claim(tmp_path / "done", resume=True, steps=8)
    with pytest.raises(RunFolderError, match="holds a grpo run .* this is a ppo run"):
        claim(tmp_path / "done", resume=True, steps=20, algorithm="ppo")
    for step in (5, 10):
        garble(tmp_path / f"done/checkpoints/step-{step}/__0_0.distcp")
    with pytest.raises(RunFolderError, match="no intact checkpoint .*step-10: checksum mismatch.*step-5: checksum"):
        claim(tmp_path / "done", resume="auto", steps=20)


def test_resume_auto_restarts_a_run_that_never_saved_a_checkpoint(tmp_path):
    first = claim(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # it crashed before its first checkpoint
    again = claim(tmp_path, resume="auto")
    assert again.resume_from is None and again.run_id != first.run_id and not (tmp_path / "metrics.jsonl").exists()


@contextlib.contextmanager
def read_only_dir(path: Path):
    """A directory nothing can be written into: a read-only tmpfs as root (who may write anywhere else), else
    a directory without write permission."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        yield path
        path.chmod(0o700)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1M", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def command_line(capsys):
    """Run a recipe's command line in this process; returns (exit status, stdout, stderr). Its signal handlers
    are put back after."""
    from forge_rl.recipes import recipe
    from forge_rl.recipes.command_line import run_from_command_line

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def run(name: str, config: Path, *overrides: str) -> tuple[int, str, str]:
        module = recipe(name)
        try:
            run_from_command_line(module.CONFIG, module.main, name, ["--config", str(config), *overrides])
            status = 0
        except SystemExit as e:
            status = e.code
        out, err = capsys.readouterr()
        return status, out, err

    yield run
    for s, handler in handlers.items():
        signal.signal(s, handler)


def test_output_folder_and_resume_mistakes_end_in_one_line_and_status_2(tmp_path, command_line):
    """Each is found before any actor starts (the stand-in trainer never runs: no procs here)."""
    finished_run(tmp_path / "done")
    (tmp_path / "a_file").write_text("x")
    with read_only_dir(tmp_path / "read_only") as read_only:
        cases = {
            "output_dir is a file": ([f"output_dir={tmp_path}/a_file"], "output_dir=.*a_file is a file"),
            "output_dir under a file": ([f"output_dir={tmp_path}/a_file/run"], "output_dir=.*cannot be written"),
            "output_dir read-only": ([f"output_dir={read_only}/run"], "output_dir=.*cannot be written"),
            "a second run": ([f"output_dir={tmp_path}/done"], "already holds run .* overwrite=true"),
            "resume=true, no checkpoint": ([f"output_dir={tmp_path}/new", "resume=true"], "no intact checkpoint"),
            "steps below the checkpoint": (
                [f"output_dir={tmp_path}/done", "resume=true", "steps=3"],
                "steps=3 is below",
            ),
        }
        for case, (overrides, line) in cases.items():
            status, out, err = command_line("grpo", TINY, *overrides)
            assert status == 2, (case, status, out, err)
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err, (case, err)
            assert re.search(line, err), (case, err)
    status, out, err = command_line("sft", REPO / "configs/sft/tiny.yaml", f"output_dir={tmp_path}/done")
    assert status == 2 and "already holds" in err  # SFT's runs own their folders the same way
    status, out, err = command_line("grpo", TINY, f"output_dir={tmp_path}/done", "resume=auto", "steps=10")
    assert status == 0 and "is complete" in out and err == ""


def test_resume_auto_refuses_a_run_whose_checkpoints_are_elsewhere_and_leaves_it_as_it_was(tmp_path):
    """The run saved its checkpoints in another trainer.checkpoint_dir; the rerun forgot that override. Its
    outputs are not a run's "that never saved a checkpoint": refused in one line naming the key."""
    out, elsewhere = tmp_path / "run", tmp_path / "ckpts"
    run_id = claim_output_dir(out, elsewhere, algorithm="grpo", resume=False, overwrite=False, steps=10).run_id
    write_checkpoint(elsewhere, 2, run_id)
    (out / "metrics.jsonl").write_text('{"step": 2}\n')
    (out / "summary.json").write_text('{"steps": 2}\n')
    before = snapshot(tmp_path)
    with pytest.raises(RunFolderError) as refused:
        claim(out, resume="auto")
    assert f"trainer.checkpoint_dir={elsewhere.resolve()}" in str(refused.value) and "\n" not in str(refused.value)
    assert snapshot(tmp_path) == before
    with pytest.raises(RunFolderError, match=f"saved its checkpoints in trainer.checkpoint_dir={elsewhere.resolve()}"):
        claim(out, resume=True)
    assert claim_output_dir(out, elsewhere, algorithm="grpo", resume="auto", overwrite=False, steps=10).resume_step == 2


def test_resume_finishes_a_save_that_a_crash_stopped_before_its_rename(tmp_path):
    """The manifest of step-4 was written, then the process died before the rename: resume=auto continues from
    it, rather than taking the run for one that never saved a checkpoint and removing it."""
    run_id = claim(tmp_path).run_id
    step_4 = write_checkpoint(tmp_path / "checkpoints", 4, run_id)
    step_4.rename(tmp_path / "checkpoints" / f".step-4.{run_id}.partial")  # as the crash left it
    (tmp_path / "metrics.jsonl").write_text('{"step": 4}\n')
    resumed = claim(tmp_path, resume="auto", steps=10)
    assert resumed.run_id == run_id and resumed.resume_step == 4 and (tmp_path / "metrics.jsonl").exists()


def test_overwrite_never_removes_another_runs_checkpoints_in_a_shared_checkpoint_dir(tmp_path):
    """Two output folders share one trainer.checkpoint_dir: replacing the run of one (overwrite=true) must not
    remove the other's checkpoints, nor write its own step-N over them. Refused, naming the other run."""
    shared = tmp_path / "shared"
    first = claim_output_dir(tmp_path / "a", shared, algorithm="grpo", resume=False, overwrite=False, steps=10)
    for step in (5, 10):
        write_checkpoint(shared, step, first.run_id)
    (tmp_path / "b").mkdir()
    (tmp_path / "b/metrics.jsonl").write_text('{"step": 3}\n')  # b's run, replaced with overwrite=true
    before = snapshot(shared)
    for overwrite in (False, True):
        with pytest.raises(RunFolderError) as refused:
            claim_output_dir(tmp_path / "b", shared, algorithm="grpo", resume=False, overwrite=overwrite, steps=10)
        assert first.run_id in str(refused.value) and "choose another trainer.checkpoint_dir" in str(refused.value)
        assert snapshot(shared) == before
