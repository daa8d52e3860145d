"""Shutdown leaves no child processes and nothing in /dev/shm: normal exit, exception, Ctrl-C, SIGTERM."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_rl.runtime.reaper import POLL_S
from tests.conftest import REPO, started_in_the_background
from tests.support.run_shm import RunShm


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but unreaped; it holds nothing.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.parametrize("how", ["normal", "exception", "sigint", "sigterm", "sigkill"])
def test_shutdown_leaves_no_processes_or_shm(how):
    """However the controller ends, SIGKILL included (nothing runs in it then), its procs, what they started
    and the run's shared memory are gone within seconds. Only this run's /dev/shm entries are looked at: other
    runs on the machine come and go meanwhile."""
    seen = RunShm()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.shutdown_script", how],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=started_in_the_background,
    )
    pids, shm, lines = [], [], []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("RUN"):
            seen.run_ids.add(line.split()[1])
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
        if line.startswith("SHM"):
            shm = line.split()[1:]
            assert all(Path(p).exists() for p in shm)
            seen.entries.update(Path(p).name for p in shm)
        if line.startswith("CHILDREN"):
            pids += [int(p) for p in line.split()[1:]]
        if line.startswith("READY"):
            proc.send_signal({"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}.get(how, signal.SIGINT))
            if how == "sigkill":
                break  # it prints nothing more, and what it leaves behind may hold the pipe open
    code = proc.wait(timeout=120)
    output = "".join(lines)
    assert len(pids) == (6 if how == "sigkill" else 3) and len(shm) == 3 and seen.run_ids, output
    if how == "normal":
        assert code == 0, output
    elif how == "exception":
        assert code != 0 and "controller failed on purpose" in output
    elif how == "sigkill":
        assert code == -signal.SIGKILL
    else:
        assert code != 0 and "KeyboardInterrupt" in output
    deadline = time.time() + 15
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "actor procs (or what they started) outlived the controller"
    deadline = time.time() + 10
    while time.time() < deadline and [p for p in shm if Path(p).exists()]:
        time.sleep(0.2)
    assert not [p for p in shm if Path(p).exists()], "run's shared memory left behind"
    assert seen.left() == []  # the registry of its processes (forge_rl-<run>-pids) too


def test_reaper_kills_what_a_killed_proc_started_and_removes_its_shared_memory():
    """A proc SIGKILLed with a child running (as a generator with its vLLM EngineCore): the child dies
    too, and the /dev/shm file it mapped (as vLLM's broadcast segment) is removed."""
    import psutil

    child_code = (
        "import mmap, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "os.ftruncate(fd, 1 << 20)\n"
        "m = mmap.mmap(fd, 1 << 20)\n"
        "time.sleep(600)\n"
    )
    segment = Path(f"/dev/shm/reaper-test-{os.getpid()}")
    script = (
        "import subprocess, sys, time\n"
        "from forge_rl.runtime.reaper import reap_descendants_on_exit\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}, {str(segment)!r}])\n"
        "reap_descendants_on_exit()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    try:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
        child = psutil.Process(int(proc.stdout.readline()))
        deadline = time.monotonic() + 30
        while not _maps(child.pid, segment) and time.monotonic() < deadline:  # the child has mapped it
            time.sleep(0.05)
        assert _maps(child.pid, segment), f"the child did not map {segment} within 30 s"
        time.sleep(2 * POLL_S)  # a scan of the reaper's has seen the mapping (it says so nowhere we could poll)
        proc.kill()
        proc.wait()  # the child is now an orphan: nothing but the reaper stops it
        gone, still = psutil.wait_procs([child], timeout=10)
        assert gone and not still
        deadline = time.monotonic() + 10
        while segment.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not segment.exists(), "the killed child's shared memory was left behind"
    finally:
        segment.unlink(missing_ok=True)


def _maps(pid: int, path: Path) -> bool:
    try:
        return str(path) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # not started yet, or gone
        return False


def test_reaper_leaves_a_living_proc_alone():
    from forge_rl.runtime.reaper import reap_descendants_on_exit

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        reaper = reap_descendants_on_exit()
        time.sleep(1.5)
        assert reaper.poll() is None and child.poll() is None
    finally:
        child.kill()
        child.wait()
    reaper.kill()
    reaper.wait()


def test_sigkill_of_a_grpo_run_in_the_background_leaves_nothing(tmp_path):
    """What a user does to a stuck run: `kill -9` of the GRPO app started in the background. Its procs,
    vLLM's EngineCore and Worker processes and the run's shared memory must all go with it."""
    import psutil

    app = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apps.grpo.main",
            "--config",
            "configs/grpo/tiny.yaml",
            "steps=500",
            "eval_size=16",
            "eval_every=0",
            f"output_dir={tmp_path}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=started_in_the_background,
    )
    lines = []
    for line in app.stdout:
        lines.append(line)
        if line.lstrip().startswith("step    2 |"):
            break
    descendants = psutil.Process(app.pid).children(recursive=True)
    names = " ".join(p.name() for p in descendants)
    assert "VLLM::EngineCor" in names, "".join(lines[-20:])  # the engine is running: the case that leaked
    seen = RunShm()  # this run's /dev/shm entries only: other runs on the machine come and go meanwhile
    seen.see(psutil.Process(app.pid))
    assert seen.run_ids and any(n.startswith("forge_rl-") for n in seen.entries), seen.entries
    app.kill()
    app.wait()
    gone, alive_procs = psutil.wait_procs(descendants, timeout=20)
    assert not alive_procs, f"outlived the controller: {[(p.pid, p.name()) for p in alive_procs]}"
    deadline = time.time() + 10
    while time.time() < deadline and seen.left():
        time.sleep(0.2)
    assert seen.left() == [], f"the run's /dev/shm entries outlived it (of {sorted(seen.entries)})"
