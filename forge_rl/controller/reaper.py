"""Kill what a proc started when the proc dies, however it dies.

vLLM's AsyncLLM runs its EngineCore (and, on some platforms, a worker) in child processes. When a
generator proc is SIGKILLed, or the OOM killer takes it, nothing runs in it to stop them: they are
reparented to init and keep their memory (about 1 GiB each for the tiny model on CPU) and their
CPU-bound busy loops for the rest of the machine's life.

Killed that way they also leave their shared memory behind: vLLM's executor broadcasts through a
240 MiB /dev/shm segment (psm_*) that only a clean shutdown unlinks.

`reap_descendants_on_exit()` starts a small watcher process in its own session (so a signal to the
proc's process group does not reach it). While the proc lives, the watcher records the proc's
descendants, and the /dev/shm files they map, every POLL_S. Once the proc is gone, it terminates
the processes it last saw (SIGTERM, then SIGKILL after GRACE_S), each identified by pid and start
time so that a reused pid is never hit, and unlinks the files they mapped that no living process
maps. After a clean shutdown there is nothing left to do and the watcher just exits.
"""

import os
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 3.0


def reap_descendants_on_exit(pid: int | None = None) -> subprocess.Popen:
    """Start the watcher for `pid` (default: this process) and return once it has recorded the
    descendants `pid` has now; later ones are picked up while `pid` lives (every POLL_S)."""
    pid = pid or os.getpid()
    # Run as a plain script: importing the forge_rl package would pull in torch and Monarch (seconds of
    # start-up, hundreds of MB) into a process that needs psutil alone.
    watcher = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    watcher.stdout.readline()  # "ready": it has listed what exists now
    watcher.stdout.close()
    return watcher


def _same_process(proc: psutil.Process, started: float) -> bool:
    try:
        return proc.is_running() and proc.create_time() == started
    except psutil.Error:
        return False


def _shm_files(pids) -> set[str]:
    """The /dev/shm files these processes map."""
    files = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                files.update(line.split(None, 5)[5].strip() for line in f if " /dev/shm/" in line)
        except (OSError, IndexError):
            pass
    # A run's own files (forge_rl-<run>-*, e.g. weight versions an engine was reloading from) belong
    # to that run's cleanup: other procs of the run still use them.
    return {f for f in files if not f.endswith("(deleted)") and not f.startswith("/dev/shm/forge_rl-")}


def _mapped_by_anyone(files: set[str]) -> set[str]:
    return _shm_files(int(p) for p in os.listdir("/proc") if p.isdigit()) & files


def watch(pid: int) -> tuple[list[int], list[str]]:
    """Block until `pid` dies, then terminate its last seen descendants and unlink the shared memory
    they left. Returns (pids killed, files removed)."""
    me = os.getpid()
    try:
        parent = psutil.Process(pid)
        parent_started = parent.create_time()
    except psutil.NoSuchProcess:
        return [], []
    seen: dict[int, tuple[psutil.Process, float]] = {}
    shm: set[str] = set()
    ready = False
    while _same_process(parent, parent_started):
        try:
            seen = {p.pid: (p, p.create_time()) for p in parent.children(recursive=True) if p.pid != me}
            shm = _shm_files(seen)
        except psutil.Error:
            pass  # a process ended while we listed: keep the last list, look again next round
        if not ready:
            _tell_ready()
            ready = True
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
    psutil.wait_procs(alive, timeout=GRACE_S)
    left = [f for f in shm - _mapped_by_anyone(shm) if os.path.exists(f)] if orphans else []
    for f in left:
        try:
            os.unlink(f)
        except FileNotFoundError:
            pass
    return [p.pid for p in orphans], left


def _tell_ready() -> None:
    try:
        print("ready", flush=True)
        sys.stdout.close()  # nothing more goes to the starter (who closes its end)
    except (BrokenPipeError, ValueError):
        pass


if __name__ == "__main__":
    killed, removed = watch(int(sys.argv[1]))
    if killed:
        print(
            f"forge_rl reaper: proc {sys.argv[1]} died; terminated its orphaned processes {killed}"
            + (f" and removed the shared memory they left: {removed}" if removed else ""),
            file=sys.stderr,
        )
