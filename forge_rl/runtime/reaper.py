"""Kill what a proc started when the proc dies, however it dies.

vLLM's AsyncLLM runs its EngineCore (and, on some platforms, a worker) in child processes. When a
generator proc is SIGKILLed, or the OOM killer takes it, nothing runs in it to stop them: they are
reparented to init and keep their memory (a model and a KV cache each) and their
CPU-bound busy loops for the rest of the machine's life.

Killed that way they also leave their shared memory behind: vLLM's executor broadcasts through a
/dev/shm segment (psm_*) that only a clean shutdown unlinks.

The same happens to every proc when the controller itself is SIGKILLed (what a user does to a stuck run):
Monarch's procs exit with it, and their children live on. So the provisioner watches the controller too.

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
CONTROLLER_ENV = "FORGE_RL_CONTROLLER"  # "<pid>-<start time>" of the controller a process was started under


def reap_descendants_on_exit(pid: int | None = None, run_id: str | None = None) -> subprocess.Popen:
    """Start the watcher for `pid` (default: this process) and return once it has recorded the
    descendants `pid` has now; later ones are picked up while `pid` lives (every POLL_S).

    With `run_id` (the controller's watcher, `pid` must be this process): every process started from here
    on inherits the marker CONTROLLER_ENV, so once `pid` is gone the watcher finds them all, however they
    were reparented and however recently they started. It reads no shared-memory maps (each generator proc
    has its own watcher for its engine's segments) and, once every process registered with the run is
    dead, removes the run's /dev/shm/forge_rl-<run_id>-* entries."""
    pid = pid or os.getpid()
    args = [str(pid)]
    if run_id is not None:
        if pid != os.getpid():
            raise ValueError("reap_descendants_on_exit: run_id is for watching this process")
        os.environ[CONTROLLER_ENV] = marker = f"{pid}-{psutil.Process(pid).create_time()}"
        args += ["--run-id", run_id, "--marker", marker]
    # Run as a plain script: importing the forge_rl package would pull in torch and Monarch (seconds of
    # start-up, hundreds of MB) into a process that needs psutil alone.
    watcher = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    watcher.stdout.readline()  # "ready": it has listed what exists now
    watcher.stdout.close()
    return watcher


def _same_process(proc: psutil.Process, started: float) -> bool:
    """`proc` is the process that started at `started`, and has not exited (a zombie has: its children are
    already reparented)."""
    try:
        return proc.is_running() and proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_watcher(proc: psutil.Process) -> bool:
    try:
        return os.path.abspath(__file__) in proc.cmdline()
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


def _marked(marker: str) -> dict[int, tuple[psutil.Process, float]]:
    """Every process whose environment carries CONTROLLER_ENV=marker."""
    needle = f"{CONTROLLER_ENV}={marker}".encode()
    found = {}
    for p in psutil.process_iter():
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found[p.pid] = (p, p.create_time())
        except (OSError, psutil.Error):
            pass
    return found


def watch(pid: int, run_id: str | None = None, marker: str | None = None) -> tuple[list[int], list[str]]:
    """Block until `pid` dies, then terminate its descendants and unlink the shared memory they left.
    Returns (pids killed, files removed).

    Every descendant seen is remembered until it exits, even once it is no longer a descendant: when `pid`
    dies its children are reparented at once, before `pid` is reaped, so a last look then finds none."""
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
            now = {p.pid: (p, p.create_time()) for p in parent.children(recursive=True) if p.pid != me}
            seen = {k: v for k, v in seen.items() if _same_process(*v)} | now
            if run_id is None:
                shm = _shm_files(now) | {f for f in shm if os.path.exists(f)}
        except psutil.Error:
            pass  # a process ended while we listed: keep the last list, look again next round
        if not ready:
            _tell_ready()
            ready = True
        time.sleep(POLL_S)
    if marker is not None:
        seen |= {k: v for k, v in _marked(marker).items() if k != me}
    # Other watchers (a generator proc's) do their own cleanup, shared memory included: leave them be.
    orphans = [p for p, started in seen.values() if _same_process(p, started) and not _is_watcher(p)]
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
    if run_id is not None:
        left += _remove_run_if_dead(run_id)
    return [p.pid for p in orphans], left


def _remove_run_if_dead(run_id: str) -> list[str]:
    """The run's /dev/shm entries, once no process registered with the run lives (forge_rl/weights/runs.py,
    loaded from its file: importing the package would pull in torch)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights", "runs.py")
    spec = importlib.util.spec_from_file_location("_forge_rl_runs", path)
    runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runs)
    deadline = time.monotonic() + GRACE_S
    while runs.live_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    if runs.live_processes(run_id):
        return []
    return [str(runs.SHM_DIR / name) for name in runs.remove_run(run_id)]


def _tell_ready() -> None:
    try:
        print("ready", flush=True)
        sys.stdout.close()  # nothing more goes to the starter (who closes its end)
    except (BrokenPipeError, ValueError):
        pass


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="stop what a process started once it dies (forge_rl)")
    ap.add_argument("pid", type=int)
    ap.add_argument("--run-id")
    ap.add_argument("--marker")
    args = ap.parse_args()
    killed, removed = watch(args.pid, args.run_id, args.marker)
    if killed or removed:
        print(
            f"forge_rl reaper: process {args.pid} died; terminated its orphaned processes {killed}"
            + (f" and removed the shared memory they left: {removed}" if removed else ""),
            file=sys.stderr,
        )
