import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Monarch procs are new Python processes: let them import test actors (tests/support/actors.py).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
TINY_MODEL = REPO / "forge_rl" / "models" / "tiny"

# tests/integration/ holds the tests that start real processes (Monarch procs, a vLLM engine, TorchTitan ranks,
# Slurm, a notebook kernel): they are marked `integration`, and `make test-fast` leaves them out (CONTRIBUTING.md).
INTEGRATION = REPO / "tests" / "integration"


def pytest_collection_modifyitems(config, items):
    import torch

    from tests.support.module_seconds import longest_first

    # whole modules, longest first (`make test` hands them to its workers in this order: module_seconds.py says why)
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    start = {module: i for i, module in enumerate(longest_first(modules))}
    items.sort(key=lambda item: start[item.nodeid.split("::")[0]])

    no_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU, and none is visible here: `make gpu-check` runs the gpu "
        "tier on a GPU machine (the CPU side of its logic: tests/unit/gpu_check/test_gpu_logic.py)"
    )
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)
        if "gpu" in item.keywords and not torch.cuda.is_available() and not on_cpu(item):
            item.add_marker(no_gpu)


def on_cpu(item) -> bool:
    """The no-vLLM GPU tier (tests/gpu/test_gpu.py) runs on CPU as a logic check when `make gpu-check` asks for it."""
    return item.path.name == "test_gpu.py" and os.environ.get("FORGE_GPU_TIER_ON_CPU") == "1"


def started_in_the_background() -> None:
    """A subprocess preexec_fn: what `cmd &` in a non-interactive shell (nohup, CI, a batch step) gives a
    child, SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run(coro, timeout: float = 300):
    """Run one async test body to completion (each test gets a fresh event loop)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int):
    """A real tmpfs of `size` bytes mounted at `path` for the block (a full /dev/shm in miniature).
    Skips the test where mounting is not permitted."""
    if shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs the mount command, which is not installed")
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        why = (mounted.stderr.strip().splitlines() or [f"mount exited with {mounted.returncode}"])[0]
        pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {why}")
    try:
        yield path
    finally:
        # Lazily if something still maps a file there (a failing test's actor): unmounted either way.
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def provisioned_loop():
    """An event loop with a provisioner, closed with it (a generator: for fixtures to yield from)."""
    from forge_rl.runtime import provisioned

    loop = asyncio.new_event_loop()
    ctx = provisioned()
    loop.run_until_complete(ctx.__aenter__())
    yield loop
    loop.run_until_complete(ctx.__aexit__(None, None, None))
    loop.close()


@pytest.fixture(scope="module")
def loop():
    """An event loop with a provisioner for the whole test module: its actors live across its tests."""
    yield from provisioned_loop()


@pytest.fixture
def tiny_model_dir() -> Path:
    return TINY_MODEL
