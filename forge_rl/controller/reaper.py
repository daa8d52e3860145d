"""Kill what a proc started when the proc dies, however it dies.

vLLM's AsyncLLM runs its EngineCore (and, on some platforms, a worker) in child processes. When a
generator proc is SIGKILLed, or the OOM killer takes it, nothing runs in it to stop them: they are
reparented to init and keep their memory (about 1 GiB each for the tiny model on CPU) and their
CPU-bound busy loops for the rest of the machine's life.

`reap_descendants_on_exit()` starts a small watcher process in its own session (so a signal to the
proc's process group does not reach it). While the proc lives, the watcher records the proc's
descendants every POLL_S; once the proc is gone, it terminates the ones it last saw (SIGTERM, then
SIGKILL after GRACE_S). Each is identified by pid and start time, so a reused pid is never hit.
After a clean shutdown there is nothing left to kill and the watcher just exits.
"""

import os
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 3.0


def reap_descendants_on_exit(pid: int | None = None) -> subprocess.Popen:
    """Start the watcher for `pid` (default: this process). Call it after the children exist or
    before: the watcher keeps refreshing its list while `pid` lives."""
    pid = pid or os.getpid()
    return subprocess.Popen(
        [sys.executable, "-m", "forge_rl.controller.reaper", str(pid)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _same_process(proc: psutil.Process, started: float) -> bool:
    try:
        return proc.is_running() and proc.create_time() == started
    except psutil.Error:
        return False


def watch(pid: int) -> list[int]:
    """Block until `pid` dies, then terminate its last seen descendants. Returns the pids killed."""
    me = os.getpid()
    try:
        parent = psutil.Process(pid)
        parent_started = parent.create_time()
    except psutil.NoSuchProcess:
        return []
    seen: dict[int, tuple[psutil.Process, float]] = {}
    while _same_process(parent, parent_started):
        try:
            seen = {p.pid: (p, p.create_time()) for p in parent.children(recursive=True) if p.pid != me}
        except psutil.Error:
            pass  # a process ended while we listed: keep the last list, look again next round
        time.sleep(POLL_S)
    orphans = [p for p, started in seen.values() if _same_process(p, started)]
    for p in orphans:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(orphans, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [p.pid for p in orphans]


if __name__ == "__main__":
    killed = watch(int(sys.argv[1]))
    if killed:
        print(f"forge_rl reaper: proc {sys.argv[1]} died; terminated its orphaned processes {killed}", file=sys.stderr)
