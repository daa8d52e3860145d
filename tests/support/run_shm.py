"""The /dev/shm entries of one run, so that a check of what a run left behind looks at that run alone: other runs
on the same machine (tests beside it, another user's job) create and remove entries of their own meanwhile.

A run's entries are /dev/shm/forge_rl-<run_id>-* (its weight store and its process registry,
forge_rl/weights/runs.py) and whatever else its processes map or hold open there (vLLM's and torch's segments).

    seen = RunShm()
    seen.see(psutil.Process(app.pid))   # while it runs, as often as entries may come and go
    ...                                 # the run ends, however it ends
    assert seen.left() == []

The run id comes from the environment of the app's descendants: the provisioner sets FORGE_RL_RUN_ID before it
starts a proc. The app's own environment is not read: it may carry the id of the run that started it.
"""

import os
from pathlib import Path

import psutil

from forge_rl.weights.runs import RUN_ID_ENV, SHM_DIR, run_prefix


class RunShm:
    def __init__(self) -> None:
        self.run_ids: set[str] = set()
        self.entries: set[str] = set()  # names directly under /dev/shm

    def see(self, root: psutil.Process) -> None:
        """Add what `root` and its descendants map or hold open in /dev/shm now, and the run's named entries."""
        try:
            descendants = root.children(recursive=True)
        except psutil.Error:
            descendants = []
        for proc in descendants:
            try:
                if run_id := proc.environ().get(RUN_ID_ENV):
                    self.run_ids.add(run_id)
            except psutil.Error:
                continue
        for proc in [root, *descendants]:
            self.entries.update(_held_in_shm(proc.pid))
        self.entries.update(self._named())

    def left(self) -> list[str]:
        """The run's entries still in /dev/shm."""
        return sorted({name for name in self.entries if (SHM_DIR / name).exists()} | self._named())

    def _named(self) -> set[str]:
        return {p.name for run_id in self.run_ids for p in SHM_DIR.glob(run_prefix(run_id) + "*")}


def _held_in_shm(pid: int) -> set[str]:
    """The /dev/shm entries (names directly under it) that process `pid` maps or has open."""
    paths = []
    try:
        with open(f"/proc/{pid}/maps") as maps:
            paths += [line.split(None, 5)[5].strip() for line in maps if " /dev/shm/" in line]
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                paths.append(os.readlink(f"{fd_dir}/{fd}"))
            except OSError:
                continue  # closed meanwhile
    except OSError:  # gone, or not ours to read
        pass
    shm = str(SHM_DIR) + "/"
    return {Path(p.removesuffix(" (deleted)")).relative_to(SHM_DIR).parts[0] for p in paths if p.startswith(shm)}
