"""Hostile reward functions (TRL signature), for the reward pool's and the hostile-verifier run's tests: each
misbehaves on the groups whose prompt falls in its share (`one_in`, `residue`: crc32 of the prompt), and on
those only; on the others it scores like exact_match, so a run still learns from the groups left."""

import os
import signal
import time
import zlib


def _hit(prompts: list, one_in: int, residue: int) -> bool:
    return one_in > 0 and zlib.crc32(str(prompts[0]).encode()) % one_in == residue


def _exact(completions: list[str], answer: list) -> list[float]:
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def hangs(prompts, completions, answer, one_in: int = 1, residue: int = 0, **_):
    """Never returns (a verifier stuck on a pathological answer)."""
    while _hit(prompts, one_in, residue):
        time.sleep(60)
    return _exact(completions, answer)


def segfaults(prompts, completions, answer, one_in: int = 1, residue: int = 0, **_):
    """Dies of SIGSEGV (a C extension's crash)."""
    if _hit(prompts, one_in, residue):
        os.kill(os.getpid(), signal.SIGSEGV)
    return _exact(completions, answer)


def allocates(prompts, completions, answer, one_in: int = 1, residue: int = 0, **_):
    """Allocates without bound, touching every page (a verifier expanding an expression forever)."""
    held = []
    while _hit(prompts, one_in, residue):
        held.append(bytearray(64 << 20))
    return _exact(completions, answer)


def scaled_length(prompts, completions, scale: float = 1.0, **_):
    """A well-behaved reward with a fixed argument (bound by functools.partial in the worker)."""
    return [scale * len(c) for c in completions]


def says_which_process(prompts, completions, **_):
    """This worker's pid, for every completion: which process ran the call."""
    return [float(os.getpid())] * len(completions)


def raises(prompts, completions, **_):
    raise ZeroDivisionError("reward failed on purpose")


def wrong_length(prompts, completions, **_):
    return [1.0] * (len(completions) + 1)


def sleeps(prompts, completions, seconds: float = 1.0, **_):
    """A slow, well-behaved verifier."""
    time.sleep(seconds)
    return [0.0] * len(completions)


def returns_str(prompts, completions, **_):
    """A classic slip: the score as text."""
    return "0.5"


def returns_strings(prompts, completions, **_):
    return ["1.0"] * len(completions)


def escapes_then_hangs(prompts, completions, pid_file: str, **_):
    """Starts a process that leaves the worker's session and parent (setsid, orphaned by its shell), writes its
    pid to `pid_file`, then never returns: the timeout must kill that process too."""
    import subprocess

    subprocess.run(["sh", "-c", f"setsid sleep 600 > /dev/null 2>&1 & echo $! > {pid_file}"], check=True)
    while True:
        time.sleep(60)


def closes_its_pipe(prompts, completions, **_):
    """Closes every inherited descriptor (the worker's pipe among them) and keeps the process alive with a
    thread: the worker lives on, deaf."""
    import threading

    threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: the interpreter waits for it
    os.closerange(3, 4096)
    return [0.0] * len(completions)
