"""`make gpu-check` (gpu_check/__main__.py) where there is no GPU, as in CI: it says up front which tiers run
here and why not the others, runs its CPU logic tests and the no-vLLM tier on CPU with vLLM made unimportable
(its tests import nothing from vLLM), and says that the GPU part did not run. (A test of its own file: the
check runs tests/unit/gpu_check/test_gpu_logic.py and tests/gpu/test_gpu.py.)"""

import re
import subprocess
import sys

from tests.conftest import REPO


def test_gpu_check_says_what_runs_here_runs_its_cpu_part_and_says_when_the_gpu_part_did_not_run(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "gpu_check", "--cpu-only", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    head = out.stdout.splitlines()[:4]
    assert head[0].startswith("gpu-check on this host: Python ") and ", no CUDA, vLLM " in head[0]
    assert head[1:] == [
        "  CPU logic tier: runs (CPU tests of the CUDA-only logic)",
        "  no-vLLM tier: runs (on CPU as a logic check: --cpu-only was given, so no GPU figures)",
        "  vLLM tier: cannot run (--cpu-only was given)",
    ]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| CPU tests of the CUDA-only logic" in table and "ok:" in table and "passed" in table
    assert re.search(r"\| no-vLLM tier \(on CPU, a logic check; tests/gpu/test_gpu.py\) +\| ok: 5 passed", table), table
    for row in (
        "no-vLLM: bf16 train step",
        "no-vLLM: peak memory vs plan",
        "no-vLLM: publish (shard writes)",
        "no-vLLM: publish (rank-0 stream)",
        "no-vLLM: critic",
        "no-vLLM: bf16 dtypes and the MFU peak",
    ):
        assert f"| {row}" in table, row
    assert "| vLLM tier" in table and "| GPU part" in table and "NOT RUN" in table
    assert "the GPU part was NOT run" in out.stdout
