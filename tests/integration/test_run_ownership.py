"""A run owns its folder, on the real trainer's checkpoints: a second run in the folder is refused and leaves the
first as it was; 4 KB of garbage in a weight tensor's file is caught by the checksum and resume falls back to the
checkpoint before, naming the one it passed over; Ctrl-C in the first evaluation of a run that replaces another
(overwrite=true) says so and stops cleanly. The folder logic's cheap cases are in tests/unit/loop/test_run_folder.py."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from forge_rl.config import load_config
from forge_rl.loop.run_folder import RUN_FILE, RunFolderError
from forge_rl.observability.metrics import read_jsonl
from forge_rl.recipes.grpo import GRPOConfig, main
from forge_rl.weights.runs import RUN_ID_ENV
from tests.conftest import REPO
from tests.unit.loop.test_run_folder import finished_run, garble, snapshot

TINY = REPO / "configs/grpo/tiny.yaml"
SMALL = [
    "batch_groups=4",
    "group_size=4",
    "rollout_tasks=2",
    "eval_size=32",
    "eval_every=0",
    "buffer.capacity=8",
    "generator.sampling.max_tokens=6",
]


def wait_until_the_runs_processes_are_gone(within_s: float = 60.0) -> None:
    """Wait for the processes of the run this process last started to end. A proc's reaper outlives the run by a
    poll or two, and notes in that proc's log what it ended, so the run's folder settles only then. This process's own
    helpers live as long as it does and are not waited for: the controller's reaper (its command line names this
    process) and Python's multiprocessing helpers (the resource tracker), which carry the run id from its environment
    but write nothing to the run's folder."""
    run_id, me, deadline = os.environ[RUN_ID_ENV], os.getpid(), time.time() + within_s
    while True:
        left = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmdline = p.info["cmdline"] or []
                mine = str(me) in cmdline or (p.ppid() == me and "multiprocessing" in " ".join(cmdline))
                if p.pid != me and not mine and p.environ().get(RUN_ID_ENV) == run_id:
                    left.append(cmdline)
            except psutil.Error:
                pass
        if not left:
            return
        assert time.time() < deadline, f"run {run_id}'s processes outlived it by {within_s:.0f} s: {left}"
        time.sleep(0.5)


def test_a_damaged_tensor_is_caught_and_resume_falls_back_to_the_checkpoint_before(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = asyncio.run(
        main(
            load_config(
                GRPOConfig,
                TINY,
                SMALL + ["steps=2", f"output_dir={run_dir}", "checkpoint_every=1", "checkpoint_keep_last=0"],
            )
        )
    )
    run_id = json.loads((run_dir / RUN_FILE).read_text())["id"]
    assert first["run_id"] == run_id and first["checkpoint"] == str(run_dir / "checkpoints/step-2")

    # a second run in the same folder: refused before anything starts, the first run's files untouched
    wait_until_the_runs_processes_are_gone()
    before = snapshot(run_dir)
    with pytest.raises(RunFolderError, match=f"already holds run {run_id}'s checkpoints"):
        asyncio.run(main(load_config(GRPOConfig, TINY, SMALL + ["steps=2", f"output_dir={run_dir}"])))
    assert snapshot(run_dir) == before

    # 4 KB of garbage in the middle of step-2's weights (the largest shard file), its size unchanged
    shard = max((run_dir / "checkpoints/step-2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    garble(shard, offset=shard.stat().st_size // 2)
    capsys.readouterr()
    resumed = asyncio.run(
        main(
            load_config(
                GRPOConfig, TINY, SMALL + ["steps=3", f"output_dir={run_dir}", "resume=true", "checkpoint_keep_last=0"]
            )
        )
    )
    console = capsys.readouterr().out
    assert f"passed over step-2: checksum mismatch in {shard.name}; resuming from step-1" in console
    assert resumed["start_step"] == 1 and resumed["trainer_version"] == 3 and resumed["run_id"] == run_id
    losses = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "trainer/loss" in r]
    assert losses == [1, 2, 3]  # the step-2 retrained replaced the one whose checkpoint was damaged
    assert all(p.name in ("step-1", "step-2", "step-3") for p in (run_dir / "checkpoints").iterdir())


def test_ctrl_c_in_the_first_evaluation_says_so_and_stops_cleanly(tmp_path):
    """The run replaces an earlier run (overwrite=true), then SIGINT arrives while it evaluates step 0: it says
    nothing was trained, writes no checkpoint, exits 130 without a traceback."""
    run_dir = tmp_path / "run"
    old_id = finished_run(run_dir)
    app = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apps.grpo.main",
            "--config",
            str(TINY),
            *SMALL,
            "eval_size=500",
            "steps=2",
            f"output_dir={run_dir}",
            "overwrite=true",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    lines = []
    deadline = time.monotonic() + 400
    for line in app.stdout:
        lines.append(line)
        if line.startswith("evaluating step 0 on"):
            app.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(lines)
    output = "".join(lines) + app.communicate(timeout=120)[0]
    assert app.returncode == 130, output
    assert "interrupted at step 0: nothing trained since the start, so no checkpoint is written" in output, output
    assert "Traceback" not in output, output
    assert f"replaced run {old_id}'s checkpoints" in output, output
    assert json.loads((run_dir / RUN_FILE).read_text())["id"] != old_id
    assert list((run_dir / "checkpoints").iterdir()) == [] and not (run_dir / "hf").exists()
