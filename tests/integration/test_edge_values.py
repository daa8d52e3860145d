"""Accepted must mean it runs: the smallest values the config accepts, all at once (one step, one group of two,
a one-token response, a one-row dataset held out as itself, a buffer of one group, max_policy_age=0), run as the
app a user starts, end cleanly; the values it does not accept are refused at start-up (test_bad_inputs.py,
test_cli_fuzz.py)."""

import json
import subprocess
import sys

from tests.conftest import REPO

EDGES = [
    "steps=1",
    "batch_groups=1",
    "group_size=2",
    "rollout_tasks=1",
    "generator.sampling.max_tokens=1",
    "max_policy_age=0",
    "buffer.capacity=1",
    "eval_size=1",
    "eval_every=0",
    "checkpoint_every=1",
]


def test_the_smallest_accepted_values_together_run_to_the_end(tmp_path):
    one_row = tmp_path / "one.jsonl"
    one_row.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo/tiny.yaml", *EDGES]
        + [f"task.source={one_row}", f"task.held_out={one_row}", f"output_dir={out}", "export_dir=null"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["trainer_version"] == 1, summary
    assert (out / "checkpoints" / "step-1").is_dir()
