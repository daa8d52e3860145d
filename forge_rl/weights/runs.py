"""Who is using a run's shared memory on this host, and removing it once nobody is.

/dev/shm outlives processes: a run killed with SIGKILL leaves its versions behind. Every process
that opens a weight store (and the controller) registers itself in /dev/shm/forge_rl-<run>-pids/
as one empty file "<pid>-<start time>" (the start time guards against a reused pid). A run whose
registered processes are all dead is stale; `cleanup_stale_runs()` removes its /dev/shm/forge_rl-<run>-*
entries. It runs on every host that holds a run's shared memory: the controller's when a run starts, and each
trainer or generator host when one of its processes opens a weight store (a requeued job's workers sweep what
the killed job left on their node). The last registered process of a run on a host
removes the run's entries there when it releases (readers on hosts the controller never sees).
"""

import contextlib
import os
import shutil
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
RUN_ID_ENV = "FORGE_RL_RUN_ID"  # set by the provisioner; every proc of a run inherits it
_PREFIX = "forge_rl-"  # every shared-memory entry of a run is /dev/shm/forge_rl-<run_id>-*
_PIDS = "-pids"


def run_prefix(run_id: str) -> str:
    return f"{_PREFIX}{run_id}-"


def register_process(run_id: str, pid: int | None = None) -> None:
    pid = pid or os.getpid()
    pids = SHM_DIR / f"{_PREFIX}{run_id}{_PIDS}"
    pids.mkdir(exist_ok=True)
    (pids / process_tag(pid)).touch()


def live_processes(run_id: str) -> list[int]:
    pids = SHM_DIR / f"{_PREFIX}{run_id}{_PIDS}"
    try:
        names = os.listdir(pids)
    except FileNotFoundError:
        return []
    return [int(name.partition("-")[0]) for name in names if is_alive(name)]


def process_tag(pid: int | None = None) -> str:
    """The process as "<pid>-<start time>": it names that process only, never a later one given the same pid."""
    pid = pid or os.getpid()
    return f"{pid}-{_start_time(pid)}"


def is_alive(tag: str) -> bool:
    """Whether the process that `process_tag` named still runs."""
    pid, _, started = tag.partition("-")
    return pid.isdigit() and bool(started) and _start_time(int(pid)) == started


def release_process(run_id: str, pid: int | None = None) -> None:
    """Unregister; the last live process of the run on this host removes the run's entries."""
    pid = pid or os.getpid()
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / f"{_PREFIX}{run_id}{_PIDS}" / process_tag(pid)).unlink()
    if not live_processes(run_id):
        remove_run(run_id)


def remove_run(run_id: str) -> list[str]:
    """Remove every /dev/shm entry of the run (files and directories)."""
    removed = []
    for path in SHM_DIR.glob(run_prefix(run_id) + "*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed.append(path.name)
    return removed


def cleanup_stale_runs(grace_s: float = 60.0) -> list[str]:
    """Remove the /dev/shm entries of runs whose registered processes are all dead; return their ids.

    A run with an empty registry is left alone for `grace_s` (it may be registering right now).
    """
    stale = []
    for pids in SHM_DIR.glob(f"{_PREFIX}*{_PIDS}"):
        run_id = pids.name[len(_PREFIX) : -len(_PIDS)]
        try:
            empty, age = not os.listdir(pids), time.time() - pids.stat().st_mtime
        except FileNotFoundError:
            continue  # removed meanwhile by its own run
        if live_processes(run_id) or (empty and age < grace_s):
            continue
        remove_run(run_id)
        stale.append(run_id)
    return stale


def _start_time(pid: int) -> str:
    """The process start time in clock ticks since boot ("" if the process is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    # Fields after the parenthesised command name: state is field 3, start time field 22.
    fields = stat.rsplit(")", 1)[1].split()
    return "" if fields[0] in ("Z", "X") else fields[19]
