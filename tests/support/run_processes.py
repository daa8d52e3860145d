"""A run's processes as seen from outside it, and the ones still alive once it has ended: what the soak and chaos
benchmarks (and their tests) count as left behind."""

import time

import psutil

from forge_rl.runtime.reaper import GRACE_S, POLL_S

# After the controller exits, its watcher notices within POLL_S, then SIGTERMs what it last saw and SIGKILLs
# what is still there GRACE_S later; a proc's own watcher does the same for its engine. A process alive after
# all of that (with a second to spare) is left behind.
SWEEP_S = POLL_S + 2 * GRACE_S + 1.0


def process_ids(root: psutil.Process) -> set[tuple[int, float]]:
    """(pid, start time) of `root` and its descendants: a pid alone may be another process's by the time it is
    checked."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return set()
    ids = set()
    for proc in procs:
        try:
            ids.add((proc.pid, proc.create_time()))
        except psutil.Error:
            continue
    return ids


def left_alive(seen: set[tuple[int, float]], grace_s: float = SWEEP_S) -> list[str]:
    """The processes of `seen` still alive `grace_s` after the run ended (waiting less when all are gone sooner),
    as 'pid name'."""
    deadline = time.monotonic() + grace_s
    while (alive := [pid for pid, started in seen if _alive(pid, started)]) and time.monotonic() < deadline:
        time.sleep(0.25)
    names = []
    for pid in alive:
        try:
            names.append(f"{pid} {psutil.Process(pid).name()}")
        except psutil.Error:
            continue
    return names


def _alive(pid: int, started: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
