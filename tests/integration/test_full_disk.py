"""A run's output on a disk that fills up mid-run ends the run in one line naming the file and the room there (no
traceback, exit status 1); on a read-only one the run is refused in one line before any role starts; each time its
checkpoints stay intact, and once the room is back the same command with resume=true continues from its last
checkpoint to the end, each step's metrics row written once.
The disk is a real tmpfs mounted for the test (root, as CI is); the checkpoints are on another disk, so what the
full disk stops is the run's output (metrics, logs, timeline) rather than a checkpoint (those are stopped by name
too: tests/unit/loop/test_checkpoint_disk_full.py)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from forge_rl.loop.checkpoint import complete_checkpoints
from forge_rl.observability.metrics import read_jsonl
from tests.support.run_processes import left_alive, process_ids

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (the run's output takes ~4 MiB, its HF export ~3 MiB), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 and not os.environ.get("CI"):  # CI runs as root: there, a skip would hide a failure
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def run(tmp_path: Path, disk: Path, *extra: str) -> subprocess.Popen:
    app = [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo/tiny.yaml"]
    short = ["steps=3", "checkpoint_every=1", "eval_every=0", "eval_size=0"]
    cmd = [*app, *short, f"output_dir={disk / 'run'}", f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}", *extra]
    return subprocess.Popen(
        cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def when_checkpointed(app: subprocess.Popen, checkpoints: Path, step: int, then) -> tuple[str, str]:
    """Call `then()` as soon as checkpoint `step` is complete; the run's (stdout, stderr) once it has ended and
    its processes are gone (its watcher stops them within seconds of the app's exit)."""
    seen, done = set(), False
    deadline = time.monotonic() + 600
    while app.poll() is None and time.monotonic() < deadline:
        seen |= process_ids(psutil.Process(app.pid))
        if not done and any(p.name == f"step-{step}" for p in complete_checkpoints(checkpoints)):
            then()
            done = True
        time.sleep(0.02)
    out, err = app.communicate(timeout=600)
    assert left_alive(seen) == []
    return out, err


def one_line_of(stderr: str) -> str:
    """The run's one line: the last of its stderr, with nothing but Monarch's start-up line above it."""
    lines = [line for line in stderr.splitlines() if not line.startswith("Monarch internal logs are being written")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 2**16)
                f.flush()
        except OSError:
            pass


def test_a_full_then_read_only_output_disk_ends_in_one_line_and_resumes_to_the_end(tmp_path, small_disk):
    checkpoints = tmp_path / "checkpoints"

    app = run(tmp_path, small_disk)
    out, err = when_checkpointed(app, checkpoints, 1, lambda: fill(small_disk))
    assert app.returncode == 1, err[-3000:]
    line = one_line_of(err)
    assert line.startswith(f"forge_rl: the run stopped: its output could not be written (no space left at {small_disk}")
    assert " MiB free " in line and "resume=true" in line
    (small_disk / "filler").unlink()

    # a folder that turned read-only while no run was writing to it (one that is open for writing cannot be
    # remounted so): the resumed run says so before any role starts
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    app = run(tmp_path, small_disk, "resume=true")
    out, err = app.communicate(timeout=600)
    assert app.returncode == 2, err[-3000:]
    line = one_line_of(err)
    assert line.startswith(f"forge_rl: output_dir={small_disk / 'run'} cannot be written (Read-only file system)")
    subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)

    app = run(tmp_path, small_disk, "resume=true")
    out, err = app.communicate(timeout=600)
    assert app.returncode == 0, err[-3000:]
    assert f"resumed from {checkpoints}/step-" in out, out[-3000:]
    rows = read_jsonl(small_disk / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows if "trainer/loss" in row] == [1, 2, 3], rows  # each step's row once
    assert [p.name for p in complete_checkpoints(checkpoints)][-1] == "step-3"
