"""Ctrl-C and termination signals reach the app whatever the shell it was started from did.

A process started in the background by a non-interactive shell (`cmd &` in a script, nohup, CI, a Slurm
batch step) inherits SIGINT *ignored*; Python then installs no KeyboardInterrupt handler and asyncio.run
no cancelling one, so Ctrl-C (or `kill -INT`) does nothing. `handle_stop_signals()` installs both
explicitly before the app's event loop starts: SIGINT raises KeyboardInterrupt (asyncio.run turns it into
cancelling the app's main task, which writes its final checkpoint), and SIGTERM (scancel, a time limit)
is handled exactly like SIGINT.

`die_with_parent()` is for processes that must not outlive the process that started them: a reward worker
(its parent, the reward actor, may be SIGKILLed) and the app of an sbatch job, whose starter is Monarch's batch
runner. When Slurm ends or requeues that job, the runner dies at once (it handles no signal) and the app is
reparented; a proctrack plugin that follows parents (proctrack/linuxproc) then no longer sees it, so the old
app lived on beside the requeued job's, on the same node, output directory and /dev/shm
(tests/integration/test_slurm.py).
"""

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def handle_stop_signals() -> None:
    """Call in the main thread before asyncio.run()."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))


def die_with_parent(parent_pid: int) -> None:
    """Exit (SIGKILL, no cleanup) when the process `parent_pid` exits, however it goes (even SIGKILLed itself).
    Call it from the main thread, early: `parent_pid` is os.getppid() as seen before anything else ran."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the watchdog below still does it, within a second
        pass

    def watch() -> None:  # also covers the pdeathsig's one gap: it follows the thread that started us
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()
