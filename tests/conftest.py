import asyncio
import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Monarch procs are new Python processes: let them import test actors (tests/actors.py).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
TINY_MODEL = REPO / "forge_rl" / "models" / "tiny"


def started_in_the_background() -> None:
    """A subprocess preexec_fn: what `cmd &` in a non-interactive shell (nohup, CI, a batch step) gives a
    child, SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run(coro, timeout: float = 300):
    """Run one async test body to completion (each test gets a fresh event loop)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def tiny_model_dir() -> Path:
    return TINY_MODEL
