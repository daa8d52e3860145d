"""The notebooks under docs/notebooks run headless top to bottom in a real kernel (nbclient), re-running the
cell that spawns the actors leaks nothing, and the repository holds them without outputs."""

import copy
import os
import re
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / "docs/notebooks").glob("*.ipynb"))


def _procs_of(run_ids: set[str]) -> list[int]:
    """Processes of these forge_rl sessions (every proc a session starts carries its FORGE_RL_RUN_ID)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("FORGE_RL_RUN_ID") in run_ids and p.pid != os.getpid():
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom_and_leaves_nothing(path: Path, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in the dev extra (pip install -e .[dev])")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in the dev extra (pip install -e .[dev])")
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code), "commit notebooks stripped"
    # run the cell that starts the run twice, as a person re-running it would
    spawn = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and ".start()" in c.source)
    nb.cells.insert(spawn + 1, copy.deepcopy(nb.cells[spawn]))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    outputs = "".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "version 3: loss" in outputs and "shared memory left: none" in outputs
    assert (tmp_path / "outputs/notebook/notebook_reward.png").stat().st_size > 1000
    started = re.findall(r"session (\w+): actors up", outputs)
    assert len(started) == 2  # the start cell ran twice (one kernel: both runs carry its run id)
    sessions = set(started)
    # the second run of the cell stopped the first run, the last cell the second: nothing of either is left
    deadline = time.monotonic() + 20  # the kernel has just been shut down; its procs may be exiting
    while (left := _procs_of(sessions)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], [(p, psutil.Process(p).name(), psutil.Process(p).cmdline()[-3:]) for p in left]
    assert [p.name for p in Path("/dev/shm").iterdir() if any(s in p.name for s in sessions)] == []
