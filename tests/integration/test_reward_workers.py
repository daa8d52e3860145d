"""The reward pool: reward functions in worker processes that a hang, a segfault or unbounded allocation
costs one call, named and of its own kind, never the caller; workers killed at the timeout are replaced, and
they die with the process that started them. math-verify's own timeouts work there (a worker's main thread)."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from forge_rl.rewards.workers import RewardCrash, RewardError, RewardOutOfMemory, RewardPool, RewardTimeout
from tests.conftest import REPO

H = "tests.support.hostile_rewards:"


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture
def pool():
    pool = RewardPool(1, memory_mb=1024)
    yield pool
    pool.close()


def call(pool: RewardPool, name: str, bound=None, timeout_s: float = 30.0, **kwargs):
    return asyncio.run(pool.call(H + name, bound or {}, ["12+34="], ["46", "4"], timeout_s=timeout_s, **kwargs))


def test_a_hanging_reward_is_killed_at_the_timeout_and_its_worker_replaced(pool):
    first = int(call(pool, "says_which_process")[0])
    start = time.perf_counter()
    with pytest.raises(RewardTimeout, match="hangs' took longer than reward_timeout_s=1.0; its worker was killed"):
        call(pool, "hangs", answer=["46", "46"], timeout_s=1.0)
    assert time.perf_counter() - start < 5
    assert gone(first)  # killed, not left running beside its replacement
    second = int(call(pool, "says_which_process")[0])
    assert second != first and pool.replaced == 1
    assert call(pool, "hangs", {"one_in": 5, "residue": 4}, answer=["46", "46"]) == [1.0, 0.0]  # a group it spares


def test_a_segfault_is_a_crash_naming_the_signal_and_the_next_call_scores(pool):
    with pytest.raises(RewardCrash, match="segfaults' crashed its worker \\(killed by SIGSEGV\\)"):
        call(pool, "segfaults", answer=["46", "46"])
    assert call(pool, "scaled_length") == [2.0, 1.0] and pool.replaced == 1


def test_unbounded_allocation_hits_the_workers_memory_cap_not_the_host(pool):
    start = time.perf_counter()
    with pytest.raises(RewardOutOfMemory, match="allocates' ran out of memory \\(reward_memory_mb=1024\\)"):
        call(pool, "allocates", answer=["46", "46"])
    assert time.perf_counter() - start < 10
    assert call(pool, "scaled_length") == [2.0, 1.0]


def test_errors_are_named_and_fixed_arguments_are_bound(pool):
    assert call(pool, "scaled_length", {"scale": 0.5}) == [1.0, 0.5]  # functools.partial, in the worker
    with pytest.raises(RewardError, match="raises' raised ZeroDivisionError: reward failed on purpose"):
        call(pool, "raises")
    with pytest.raises(RewardError, match="cannot import tests.support.hostile_rewards:nothing"):
        call(pool, "nothing")
    with pytest.raises(RewardError, match="reward 'mine' returned 3 values for 2 completions"):
        asyncio.run(pool.score("mine", H + "wrong_length", {}, ["q", "q"], ["a", "b"]))
    assert pool.replaced == 0  # an exception is not a reason to replace a worker


def test_groups_score_concurrently_on_the_pools_workers():
    pool = RewardPool(2)
    try:

        async def both():
            await pool.ready()
            start = time.perf_counter()
            await asyncio.gather(*(pool.call(H + "sleeps", {"seconds": 1.5}, ["q"], ["a"]) for _ in range(2)))
            return time.perf_counter() - start

        assert asyncio.run(both()) < 2.5  # side by side, not one after the other
    finally:
        pool.close()


def test_workers_die_with_the_process_that_started_them():
    # one worker idle, one stuck in a verifier (which never reads its pipe again)
    script = (
        "import asyncio, threading, time; from forge_rl.rewards.workers import RewardPool; p = RewardPool(2); "
        "asyncio.run(p.ready()); hang = p.call('tests.support.hostile_rewards:hangs', {}, ['q'], ['a'], answer=['a']); "
        "threading.Thread(target=asyncio.run, args=(hang,), daemon=True).start(); time.sleep(1); "
        "print('ready', flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        workers = [p.pid for p in psutil.Process(parent.pid).children()]
        assert len(workers) == 2
    finally:
        os.kill(parent.pid, signal.SIGKILL)  # nothing of the parent runs after this: no cleanup of its own
        parent.wait()
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in workers)


def test_math_verifys_own_timeout_ends_a_slow_comparison_in_a_worker(pool):
    # sympy takes ~17 s on this machine to decide these differ; math-verify's SIGALRM gives up after 1 s
    start = time.perf_counter()
    values = asyncio.run(
        pool.call(
            "forge_rl.rewards.math:math_answer",
            {"verify_timeout_s": 1},
            [""],
            [r"\boxed{(x+y+z+1)^{30}}"],
            timeout_s=60,
            answer=["(x+2)^{60}"],
        )
    )
    assert values == [0.0] and time.perf_counter() - start < 8
    assert asyncio.run(
        pool.call("forge_rl.rewards.math:math_answer", {}, [""], [r"so \boxed{\frac12}"], answer=["0.5"])
    ) == [1.0]


def test_a_wrong_return_type_is_named_not_coerced(pool):
    with pytest.raises(
        RewardError, match="reward 'mine' returned str '0.5'; it must return a list of floats, one per completion"
    ):
        asyncio.run(pool.score("mine", H + "returns_str", {}, ["q", "q"], ["a", "b"]))
    with pytest.raises(
        RewardError, match="returned a list holding str '1.0' at index 0; it must return a list of floats"
    ):
        call(pool, "returns_strings")
    assert pool.replaced == 0


def test_a_timeout_kills_what_the_reward_started_even_in_a_session_of_its_own(pool, tmp_path):
    pid_file = tmp_path / "escaped.pid"
    with pytest.raises(RewardTimeout):
        call(pool, "escapes_then_hangs", {"pid_file": str(pid_file)}, timeout_s=3.0)
    escaped = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not gone(escaped) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert gone(escaped), "the setsid'd, orphaned child of a killed worker is still running"
    finally:
        if not gone(escaped):
            os.kill(escaped, signal.SIGKILL)


def test_a_worker_whose_pipe_closed_is_killed_and_replaced_not_reused(pool):
    first = int(call(pool, "says_which_process")[0])
    with pytest.raises(RewardCrash, match="closes_its_pipe' crashed its worker"):
        call(pool, "closes_its_pipe")
    assert gone(first) and pool.replaced == 1  # it lived on, deaf: killed, not put back
    assert call(pool, "scaled_length") == [2.0, 1.0]


def test_a_slot_whose_respawn_failed_starts_a_worker_at_its_next_call(pool, monkeypatch):
    start = RewardPool._start
    monkeypatch.setattr(RewardPool, "_start", lambda self: (_ for _ in ()).throw(OSError("too many open files")))
    with pytest.raises(RewardTimeout):  # its worker is killed; starting the next one fails (the fault injected)
        call(pool, "hangs", answer=["46", "46"], timeout_s=1.0)
    with pytest.raises(RewardCrash, match="could not be started: OSError: too many open files"):
        call(pool, "scaled_length")
    monkeypatch.setattr(RewardPool, "_start", start)
    assert asyncio.run(asyncio.wait_for(pool.call(H + "scaled_length", {}, ["q"], ["ab"]), 60)) == [2.0]
