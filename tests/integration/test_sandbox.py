"""The code sandbox and the code_tests reward: hostile completions end as a zero reward with a reason, the host
is unharmed, and nothing they start is left behind. Runs real bubblewrap (Debian's `bubblewrap`)."""

import os
import shutil
import time
import uuid

import psutil
import pytest

from forge_rl.rewards.sandbox import SandboxLimits, code_tests, extract_code, run_sandboxed

WHY_NOT = (
    "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (.ci/run installs it)"
    if shutil.which("bwrap") is None
    else None
)


@pytest.fixture(autouse=True)
def bwrap():
    if WHY_NOT:
        if os.environ.get("FORGE_RL_REQUIRE_SANDBOX"):  # CI installs bubblewrap: there, a skip would hide a failure
            pytest.fail(f"FORGE_RL_REQUIRE_SANDBOX is set but {WHY_NOT}")
        pytest.skip(WHY_NOT)


LIMITS = SandboxLimits(wall_s=3, cpu_s=1, memory_mb=256, file_mb=4, output_bytes=1 << 16)


def leftovers(marker: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in p.info["cmdline"] or []):
            found.append(p.pid)
    return found


@pytest.mark.parametrize(
    "name, code, reason",
    [
        ("fork bomb", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", "timeout"),
        ("infinite loop", "while True: pass", "cpu_limit"),
        ("sleeps past the wall clock", "import time; time.sleep(60)", "timeout"),
        ("reads the project", f"print(open({os.path.abspath(__file__)!r}).read())", "error"),
        ("reads the user's home", "import os; print(os.listdir('/root/.ssh'))", "error"),
        ("opens a socket", "import socket; socket.create_connection(('10.1.2.3', 80), timeout=2)", "error"),
        ("fills the disk", "f = open('/tmp/fill', 'wb')\nwhile True: f.write(b'0' * (1 << 20))", "error"),
        ("writes outside the scratch directory", "open('/usr/owned', 'w').write('x')", "error"),
        ("allocates too much", "x = bytearray(1 << 30)", "memory_limit"),
        ("floods its output", "import sys\nwhile True: sys.stdout.write('x' * 65536)", "output_limit"),
        (
            "kills its parent",
            "import os, signal; os.kill(os.getppid(), signal.SIGKILL); import time; time.sleep(60)",
            None,
        ),
    ],
)
def test_hostile_code_ends_with_a_reason_and_leaves_nothing(name, code, reason):
    marker = f"marker_{uuid.uuid4().hex}"
    start = time.monotonic()
    result = run_sandboxed(f"{marker} = 1\n{code}", LIMITS)
    assert not result.ok, name
    if reason is not None:
        assert result.reason == reason, (name, result)
    assert time.monotonic() - start < LIMITS.wall_s + 5
    assert len(result.stdout) <= LIMITS.output_bytes
    deadline = time.monotonic() + 5
    while leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftovers(marker), f"{name}: processes left behind"
    assert not os.path.exists("/usr/owned") and not os.path.exists("/tmp/fill")


def test_the_sandbox_sees_no_network_no_host_processes_and_only_its_scratch():
    result = run_sandboxed(
        "import os, socket\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(socket.gethostname())\n"
        "open('/tmp/scratch.txt', 'w').write('ok'); print(open('/tmp/scratch.txt').read())\n"
        "print(os.path.exists('/work'), os.path.exists('/home'), os.environ.get('HOME'))\n",
        LIMITS,
    )
    assert result.ok, result
    pids, host, scratch, paths = result.stdout.splitlines()
    assert len(eval(pids)) <= 3  # its own init, itself: another PID namespace
    assert host == "sandbox" and scratch == "ok" and paths == "False False /tmp"


def test_code_tests_reward_scores_solutions_by_the_rows_tests():
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
    completions = [
        "Here is the function:\n```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return a - b\n```",
        "def add(a, b): return a + b",
        "```python\nimport shutil; shutil.rmtree('/usr')\n```",
        "```python\nwhile True: pass\n```",
    ]
    # A wall clock well above a solution's start-up on a loaded 2-core machine: the rows run two at a time, and
    # a correct solution beside the busy loop must not time out (the fork bomb has tests of its own above).
    rewards = code_tests([""] * 5, completions, tests=[tests] * 5, wall_s=20, cpu_s=1)
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert os.path.isdir("/usr/bin")
    assert extract_code("a\n```py\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2\n"


def test_a_fork_bomb_is_capped_at_the_process_limit():
    code = (
        "import os, time\nn = 0\nwhile n < 1000:\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint(n)\n"
    )
    result = run_sandboxed(code, SandboxLimits(wall_s=5, processes=16))
    assert result.ok, result
    assert int(result.stdout) < 16  # the host's process table is safe, whatever user the caller is
