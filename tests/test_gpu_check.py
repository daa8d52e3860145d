"""`make gpu-check` (benchmarks/gpu_check.py) where there is no GPU, as in CI: it runs its CPU part and says
that the GPU part did not run. (A test of its own file: the check runs tests/test_gpu_logic.py.)"""

import subprocess
import sys

from tests.conftest import REPO


def test_gpu_check_runs_its_cpu_part_and_says_when_the_gpu_part_did_not_run(tmp_path):
    """`make gpu-check` without a GPU (CI): the CPU checks pass, and its table and last lines say that the GPU
    part was not run."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu-only", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| CPU tests of the CUDA-only logic" in table and "ok:" in table and "passed" in table
    assert "| GPU part" in table and "NOT RUN" in table
    assert "the GPU part was NOT run" in out.stdout
