"""Run untrusted code (a completion) in a bubblewrap sandbox with hard limits, for code-execution rewards.

    result = run_sandboxed("print(1 + 1)", SandboxLimits(wall_s=5))
    result.ok, result.stdout, result.reason     # True, "2\\n", "ok"

The sandbox (bubblewrap from Debian, `apt-get install bubblewrap`) has
- no network (a new network namespace: loopback only), no other process visible (a new PID namespace);
- a read-only view of the system's interpreter and libraries only (not /root, /home, /work, the project, its
  virtual environment), and one writable scratch directory (/tmp, a tmpfs of `scratch_mb`);
- rlimits: CPU seconds, address space, processes, file size, open files (run as root, the code runs as
  `nobody`: root is exempt from the process limit); a wall-clock limit that kills the whole PID namespace; output
  read up to `output_bytes`.

Every way a run can end is a `SandboxResult` with a reason: "ok", "error" (non-zero exit), "timeout",
"cpu_limit", "memory_limit", "output_limit", "killed". Nothing it starts outlives the call.
"""

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces on this machine; the message says which."""


@dataclass
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512  # address space
    processes: int = 32
    file_mb: int = 16  # largest file it may write
    scratch_mb: int = 64  # the writable /tmp
    open_files: int = 64
    output_bytes: int = 1 << 20  # stdout and stderr kept, each


@dataclass
class SandboxResult:
    ok: bool
    reason: str  # ok | error | timeout | cpu_limit | memory_limit | output_limit | killed
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


def _bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "the code sandbox needs bubblewrap: apt-get install bubblewrap (Debian/Ubuntu), or dnf install bubblewrap"
        )
    return path


def _ro_binds() -> list[str]:
    """The interpreter and system libraries, read-only; nothing of the user's or the project's."""
    args = []
    for path in ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc/alternatives", "/etc/ld.so.cache"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    if not os.path.exists("/usr/bin/python3"):
        base = os.path.realpath(sys.base_prefix)
        args += ["--ro-bind", base, base]
    return args


NOBODY = 65534


def _limits(limits: SandboxLimits):
    # RLIMIT_NPROC counts all of a user's processes, and root is exempt from it: as root the code runs as
    # nobody (who runs nothing else); otherwise the limit is what the user runs now plus `processes`.
    as_root = os.getuid() == 0
    running = 0 if as_root else sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"].real == os.getuid())

    def apply() -> None:  # runs in the child before bwrap: inherited by everything inside
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (running + limits.processes,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # whatever the caller inherited
        if as_root:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

    return apply


def _sandbox_command(code: str, limits: SandboxLimits) -> list[str]:
    """bwrap running the system's Python on `code`: no network, a read-only system, a small /tmp, no environment."""
    # The system's interpreter: the caller's may live where the sandbox's user cannot read (/root/.pyenv).
    python = (
        "/usr/bin/python3"
        if os.path.exists("/usr/bin/python3")
        else os.path.realpath(os.path.join(sys.base_prefix, "bin", "python3"))
    )
    return [
        _bwrap(),
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        *_ro_binds(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.scratch_mb << 20),
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
        "--disable-userns",
        "--",
        python,
        "-I",
        "-S",
        "-c",
        code,
    ]


def _outcome(status: int | None, timed_out: bool, output_full: bool, stderr: str) -> str:
    """Why the sandboxed code ended: ok, error, or the limit that stopped it."""
    if timed_out:
        return "timeout"
    if output_full:
        return "output_limit"
    if status == 0:
        return "ok"
    if status == -signal.SIGXCPU:
        return "cpu_limit"
    if "MemoryError" in stderr:
        return "memory_limit"
    if status is not None and status < 0:
        return "killed"
    return "error"


def run_sandboxed(code: str, limits: SandboxLimits | None = None, stdin: str = "") -> SandboxResult:
    """Run Python `code` in the sandbox; never raises for anything the code does."""
    limits = limits or SandboxLimits()
    cmd = _sandbox_command(code, limits)
    start = time.monotonic()
    # Output goes to files: RLIMIT_FSIZE caps them in the kernel, so a flood never fills our memory.
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=out_f, stderr=err_f, preexec_fn=_limits(limits), start_new_session=True
        )
        timed_out = False
        try:
            proc.communicate(stdin.encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # bwrap is the PID namespace's parent: killing it ends everything inside (--die-with-parent)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        wall = time.monotonic() - start
        sizes = [os.fstat(f.fileno()).st_size for f in (out_f, err_f)]
        out_f.seek(0)
        err_f.seek(0)
        stdout = out_f.read(limits.output_bytes).decode(errors="replace")
        stderr = err_f.read(limits.output_bytes).decode(errors="replace")
    status = proc.returncode
    if status is not None and status > 128:  # bwrap reports a signal that ended the code as 128 + signal
        status = -(status - 128)
    reason = _outcome(status, timed_out, max(sizes) >= min(limits.output_bytes, limits.file_mb << 20), stderr)
    return SandboxResult(reason == "ok", reason, status, stdout, stderr, wall)


# ---- a code-execution reward (TRL's signature) --------------------------------------------------------------

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block of a completion (```python ... ```), else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def code_tests(
    prompts: list, completions: list[str], tests: list, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, **_
) -> list[float]:
    """1.0 when the completion's code, followed by its row's `tests` (Python asserts: a string or a list of
    strings), runs to completion in the sandbox; 0.0 for a failed assert, an error, or any limit hit.

    In config: `{name: code_tests, weight: 1.0, args: {wall_s: 5}}`; the task needs a `tests` column."""
    limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb)
    _bwrap()  # a missing bubblewrap is an error for the run, not a zero reward

    def one(completion: str, row_tests) -> float:
        checks = "\n".join(row_tests) if isinstance(row_tests, (list, tuple)) else str(row_tests)
        return float(run_sandboxed(extract_code(completion) + "\n\n" + checks + "\n", limits).ok)

    with ThreadPoolExecutor(max_workers=max(1, min(len(completions), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, completions, tests))
