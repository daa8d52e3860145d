"""Reward functions in worker processes, so that a verifier that hangs, crashes or eats memory costs one group.

    pool = RewardPool(workers=2, memory_mb=8192, preload=["forge_rl.rewards.math:math_answer"])
    values = await pool.call("forge_rl.rewards.math:math_answer", {}, prompts, completions, timeout_s=60,
                             answer=answers)   # a list of floats, one per completion
    pool.close()

Each call runs in the main thread of one of `workers` spawned processes (never forked: the caller holds
threads and engines), which imports the function by its path ("package.module:function") and binds the
fixed keyword arguments (`functools.partial`). What can go wrong is an exception that names the function:

- it raises, or returns anything but a list of numbers (a `str`, a list of strings, a dict): `RewardError`
  naming what it returned, reason reward_error;
- it runs past `timeout_s`: its worker and every process under it is SIGKILLed and replaced, `RewardTimeout`,
  reason reward_timeout. A thread cannot be stopped; a process can, so nothing runs on;
- its worker dies (a segfault in a C extension, the kernel's OOM killer) or its pipe breaks: `RewardCrash`
  naming the signal, reason reward_crash; the worker (and its process tree) is killed and replaced;
- it allocates past `memory_mb` of address space (RLIMIT_AS): the allocation fails in the worker, not on the
  host: `RewardOutOfMemory`, reason reward_memory.

A worker is a child subreaper (PR_SET_CHILD_SUBREAPER): whatever a verifier starts stays under it, even a
process that starts a session of its own or is orphaned by a double fork, so killing a worker kills its whole
tree (`kill_tree`). A worker that fails in any way other than its function raising is killed and its slot
given a fresh worker; a slot whose respawn fails starts one at its next call instead of being lost.
Workers die with the process that started them (PR_SET_PDEATHSIG, and a watchdog on the parent's pid).
"""

import asyncio
import contextlib
import ctypes
import functools
import importlib
import math
import numbers
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping, Set
from typing import Any

import psutil

from forge_rl.launch.signals import die_with_parent

DEFAULT_MEMORY_MB = 8192  # per worker (address space): generous for sympy and a judge's client, not the host's all
STARTUP_TIMEOUT_S = 300.0  # a worker's imports (sympy, a user's judge client) on a busy machine
MESSAGE_CHARS = 500  # of an error message sent back from a worker
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
MUST_RETURN = "it must return a list of floats, one per completion"


def default_reward_workers() -> int:
    """Enough workers for a few groups scored at once, without crowding a small machine."""
    return max(2, min(4, os.cpu_count() or 1))


class RewardError(RuntimeError):
    """A reward function failed on a group; the group is dropped and counted under `reason`."""

    reason = "reward_error"


class RewardTimeout(RewardError):
    """A reward function took longer than `reward_timeout_s`; its worker was killed and replaced."""

    reason = "reward_timeout"


class RewardCrash(RewardError):
    """A reward function's worker process died (a signal: a segfault, the OOM killer); it was replaced."""

    reason = "reward_crash"


class RewardOutOfMemory(RewardError):
    """A reward function allocated past `reward_memory_mb` (its worker's address-space limit)."""

    reason = "reward_memory"


def import_function(target: str, args: dict[str, Any] | None = None):
    """The function "package.module:function" names, with `args` bound as keyword arguments."""
    module, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    return functools.partial(fn, **args) if args else fn


# ---- the worker process -------------------------------------------------------------------------------------


def _limit_memory(memory_mb: int | None) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a segfaulting verifier leaves no core file behind
    if memory_mb is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))


def _answer(fn, args: tuple, kwargs: dict) -> tuple[str, Any]:
    """("ok", [floats]) or (error kind, message): what the parent turns into a value or an exception."""
    try:
        values = fn(*args, **kwargs)
        wrong = wrong_return(values)
        return ("type", wrong[:MESSAGE_CHARS]) if wrong else ("ok", [float(v) for v in values])
    except MemoryError:
        return "memory", "MemoryError"
    except BaseException as e:  # noqa: BLE001 - a verifier's SystemExit is an error of that group, too
        return "error", f"{type(e).__name__}: {e}"[:MESSAGE_CHARS]


def _is_number(value: Any) -> bool:
    """A real number, or a 0-d array or tensor of one; never a string (float('0.5') would take it)."""
    if isinstance(value, numbers.Real):
        return True
    return not isinstance(value, (str, bytes)) and hasattr(type(value), "__float__") and getattr(value, "ndim", 0) == 0


def wrong_return(values: Any) -> str | None:
    """What is wrong with a reward function's return value (e.g. "str '0.5'"), None when it is numbers."""
    if isinstance(values, (str, bytes, Mapping, Set)) or not hasattr(values, "__iter__"):
        return f"{type(values).__name__} {values!r:.80}"
    values = list(values)
    for i, v in enumerate(values):
        if not _is_number(v):
            return f"a {type(values).__name__} holding {type(v).__name__} {v!r:.40} at index {i}"
    return None


def _worker_main(conn, parent_pid: int, memory_mb: int | None, preload: list[str]) -> None:  # in the worker
    """A worker's life: import the reward functions, then run one call at a time until the pipe closes."""
    die_with_parent(parent_pid)  # SIGKILLed with the parent, however the parent goes
    _become_subreaper()
    functions: dict[str, Any] = {}
    try:
        for target in preload:
            functions[target] = import_function(target)
        _limit_memory(memory_mb)  # after the imports: the cap is for what the calls allocate
    except BaseException as e:  # noqa: BLE001
        conn.send(("failed", f"{type(e).__name__}: {e}"[:MESSAGE_CHARS]))
        return
    conn.send(("ready", None))
    while True:
        try:
            target, bound, args, kwargs = conn.recv()
        except EOFError:  # the pool closed
            return
        try:
            fn = functions[target] if target in functions else functions.setdefault(target, import_function(target))
            fn = functools.partial(fn, **bound) if bound else fn
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"cannot import {target}: {type(e).__name__}: {e}"[:MESSAGE_CHARS]))
            continue
        conn.send(_answer(fn, args, kwargs))
        _reap_orphans()


def _become_subreaper() -> None:
    """Orphans of this worker's descendants (a daemon's double fork) become its children, not init's, so
    `kill_tree` finds every process a verifier started."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):  # not Linux: a session of its own still escapes
        pass


def _reap_orphans() -> None:
    """Collect adopted orphans that have exited (as a subreaper, nobody else will)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every process under it, however they detached (setsid, a new process group).
    Descendants go first, while `pid` (a subreaper) lives to adopt the orphans that killing makes; then `pid`."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for _ in range(100):  # a fork bomb cannot keep this going forever
        children = _living(root.children(recursive=True)) if root.is_running() else []
        if not children:
            break
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        deadline = time.monotonic() + 1.0  # dead (zombies of the worker, which reaps nothing while it computes)
        while _living(children) and time.monotonic() < deadline:
            time.sleep(0.005)
    with contextlib.suppress(psutil.NoSuchProcess):
        root.kill()


def _living(processes: list[psutil.Process]) -> list[psutil.Process]:
    living = []
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                living.append(p)
    return living


# ---- the pool, in the caller ---------------------------------------------------------------------------------

# A fresh interpreter that reads its settings from the pipe. Not multiprocessing's spawn: that runs the
# caller's __main__ again in the child, which a script without an `if __name__ == "__main__"` guard cannot take.
_BOOT = (
    "import sys; from multiprocessing.connection import Connection; conn = Connection(int(sys.argv[1])); "
    "settings = conn.recv(); sys.path[:] = settings.pop('path'); "
    "from forge_rl.rewards.workers import _worker_main; _worker_main(conn, **settings)"
)


class _Worker:
    def __init__(self, memory_mb: int | None, preload: list[str]):
        self.conn, child = multiprocessing.Pipe()
        # Its own session (setsid, done before exec): a timeout kills whatever the verifier started, too.
        # Started by exec, never forked from the caller: the caller holds threads and engines.
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(child.fileno())],
            pass_fds=[child.fileno()],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.conn.send(
            {"path": list(sys.path), "parent_pid": os.getpid(), "memory_mb": memory_mb, "preload": list(preload)}
        )
        self.ready = False

    def wait_ready(self) -> None:
        """Block until the worker has imported its functions (not counted against a call's timeout)."""
        if self.ready:
            return
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RewardError(f"a reward worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            kind, message = self.conn.recv()
        except EOFError:
            raise RewardCrash(f"a reward worker died while starting ({self.death()})") from None
        if kind != "ready":
            self.kill()
            raise RewardError(f"a reward worker could not import the reward functions: {message}")
        self.ready = True

    def kill(self) -> None:
        """SIGKILL the worker and every process under it (its tree, then its process group), and reap it."""
        kill_tree(self.process.pid)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()
        self.process.wait()
        self.conn.close()

    def alive(self) -> bool:
        return self.process.poll() is None and not self.conn.closed

    def death(self) -> str:
        try:
            code = self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return "its pipe closed while it lived on"
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"


class RewardPool:
    """`workers` processes that run reward functions; each call is one worker's for its duration."""

    def __init__(self, workers: int, memory_mb: int | None = None, preload: list[str] = ()):
        if workers < 1:
            raise ValueError(f"reward_workers must be >= 1, got {workers}")
        if memory_mb is not None and memory_mb < 64:
            raise ValueError(f"reward_memory_mb must be >= 64 (or null for no limit), got {memory_mb}")
        self.workers, self.memory_mb, self.preload = workers, memory_mb, list(preload)
        # One thread per worker, for its whole life: a worker's PR_SET_PDEATHSIG follows the thread that
        # started it, and these threads live as long as the pool. The executor's queue is the wait for a worker.
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="reward-pool")
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()  # None: a slot to start a worker in
        for started in [self._threads.submit(self._start) for _ in range(workers)]:
            self._idle.put(started.result())
        self.replaced = 0  # workers killed (timeouts) or found dead (crashes), and started anew
        self.closed = False
        # at the interpreter's exit (or when the pool is collected): a stuck verifier's worker is not left running
        multiprocessing.util.Finalize(self, self.close, exitpriority=10)

    def _start(self) -> _Worker:
        return _Worker(self.memory_mb, self.preload)

    def _take(self) -> _Worker:
        """The next idle worker; a slot left empty by a failed respawn (None) gets one started now."""
        worker = self._idle.get()
        if worker is not None:
            return worker
        try:
            return self._start()
        except Exception as e:
            self._idle.put(None)  # the slot stays, for the next call to try again
            raise RewardCrash(f"a reward worker could not be started: {type(e).__name__}: {e}") from None

    def _give_back(self, worker: _Worker, failed: bool) -> None:
        """Return a worker's slot to the pool: the worker itself if it is healthy, else (killed with its tree) a
        fresh one, or an empty slot when even that cannot start."""
        if failed or not worker.alive():
            worker.kill()  # its tree too, and reaped, so no zombie is left behind
            self.replaced += 1
            try:
                worker = self._start()
            except Exception:  # noqa: BLE001 - the slot is kept: `_take` starts one later
                worker = None
        self._idle.put(worker)

    async def ready(self) -> None:
        """Wait until every worker has imported the preloaded functions; raises RewardError if they cannot."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._threads, self._check_ready) for _ in range(self.workers)))

    def _check_ready(self) -> None:
        worker = self._take()  # FIFO: the `workers` checks, all at once, each take a different worker
        failed = True
        try:
            worker.wait_ready()
            failed = False
        finally:
            self._give_back(worker, failed)

    async def call(
        self, target: str, bound: dict[str, Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> list[float]:
        """`target(*args, **bound, **kwargs)` in a worker, as a list of floats; see the module for its errors."""
        if self.closed:
            raise RewardError("the reward pool is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._run, target, bound, args, kwargs, timeout_s)

    def _run(self, target: str, bound: dict, args: tuple, kwargs: dict, timeout_s: float | None) -> list[float]:
        worker = self._take()
        failed = True  # whatever goes wrong on the way (a timeout, a broken pipe), the worker is not reused
        try:
            worker.wait_ready()
            worker.conn.send((target, bound, args, kwargs))
            if not worker.conn.poll(timeout_s):
                raise RewardTimeout(
                    f"reward {target!r} took longer than reward_timeout_s={timeout_s}; its worker "
                    "was killed and replaced"
                )
            try:
                kind, value = worker.conn.recv()
            except (EOFError, OSError):
                raise RewardCrash(
                    f"reward {target!r} crashed its worker ({worker.death()}); the worker was replaced"
                ) from None
            failed = False
        except (BrokenPipeError, ConnectionResetError):  # the send: the worker's end is gone
            raise RewardCrash(
                f"reward {target!r} found its worker's pipe closed ({worker.death()}); the worker was replaced"
            ) from None
        finally:
            self._give_back(worker, failed)
        if kind == "memory":
            raise RewardOutOfMemory(f"reward {target!r} ran out of memory (reward_memory_mb={self.memory_mb})")
        if kind == "type":
            raise RewardError(f"reward {target!r} returned {value}; {MUST_RETURN}")
        if kind != "ok":
            raise RewardError(f"reward {target!r} raised {value}")
        return value

    async def score(
        self,
        name: str,
        target: str,
        bound: dict[str, Any],
        prompts: list,
        completions: list[str],
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> list[float]:
        """A reward function's values for a group: one finite value per completion, or a RewardError (of the
        kind `call` raised) naming the function as configured (`name`)."""
        n = len(completions)
        try:
            values = await self.call(target, bound, prompts, completions, timeout_s=timeout_s, **kwargs)
        except RewardError as e:
            raise type(e)(str(e).replace(repr(target), repr(name), 1)) from None
        except Exception as e:  # arguments that cannot be sent to a worker, say
            raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from None
        if len(values) != n:
            raise RewardError(f"reward {name!r} returned {len(values)} values for {n} completions")
        if not all(math.isfinite(v) for v in values):
            raise RewardError(f"reward {name!r} returned NaN/inf")
        return values

    def close(self) -> None:
        """Stop every worker (SIGKILL: a verifier may be stuck in a call)."""
        self.closed = True
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker is not None:
                worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


_SHARED: dict[tuple, RewardPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(workers: int, memory_mb: int | None, preload: list[str] = ()) -> RewardPool:
    """One pool per process and settings, for callers made many times over (an environment per trajectory)."""
    key = (workers, memory_mb, tuple(sorted(preload)))
    with _SHARED_LOCK:
        if key not in _SHARED or _SHARED[key].closed:
            _SHARED[key] = RewardPool(workers, memory_mb, preload)
        return _SHARED[key]
