"""Actors used by the controller tests (importable by the procs Monarch spawns)."""

import asyncio
import os
from pathlib import Path

from monarch.actor import endpoint

from forge_rl.runtime import ForgeActor


class Echo(ForgeActor):
    def __init__(self, tag: str = "echo"):
        self.tag = tag
        self.pid = os.getpid()

    @endpoint
    async def who(self, delay: float = 0.0) -> tuple[str, int]:
        await asyncio.sleep(delay)
        return self.tag, self.pid

    @endpoint
    async def fail(self) -> None:
        raise ValueError("endpoint raised on purpose")


class ShmWriter(ForgeActor):
    """Holds a file in /dev/shm named by the run id, as the weight store does."""

    @endpoint
    async def setup(self) -> None:
        from forge_rl.runtime.provisioner import RUN_ID_ENV, shm_prefix

        self.path = Path("/dev/shm") / f"{shm_prefix(os.environ[RUN_ID_ENV])}{os.getpid()}"
        self.path.write_bytes(b"\0" * 4096)

    @endpoint
    async def info(self) -> tuple[int, str]:
        return os.getpid(), str(self.path)

    @endpoint
    async def start_child(self) -> int:
        """A child process that outlives this proc unless someone stops it (as vLLM's EngineCore would)."""
        import subprocess
        import sys

        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        return self.child.pid


class DistributedProbe(ForgeActor):
    """Reports what the provisioner set up in its proc."""

    @endpoint
    async def env(self, names: list[str]) -> dict[str, str | None]:
        return {n: os.environ.get(n) for n in names}

    @endpoint
    async def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.tensor([value])
        dist.all_reduce(t)
        return t.item()

    @endpoint
    async def placement(self) -> tuple[list[int], int]:
        """The cores this proc may run on and its torch intra-op threads."""
        import torch

        return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


# Reward functions with the TRL signature that fail, for the reward actor's tests (a fault injected on purpose).
def raising_reward(prompts, completions, **_):
    raise ZeroDivisionError("reward failed on purpose")


def nan_reward(prompts, completions, **_):
    return [float("nan")] * len(completions)


def slow_reward(prompts, completions, **_):
    import time

    time.sleep(5)
    return [0.0] * len(completions)


def unit_reward(prompts, completions, unit, answer, **_):
    """A user's reward that reads an extra column: the answer, followed by the row's unit."""
    return [float(c.strip() == f"{a} {u}") for c, a, u in zip(completions, answer, unit, strict=True)]


def bonus_reward(prompts, completions, bonus, **_):
    """The row's `bonus` column, for every completion: shows a column reaching a reward."""
    return [float(b) for b in bonus]


def constant_reward(prompts, completions, **_):
    """The same reward for every completion: every group's advantages are zero (no reward signal at all)."""
    return [1.0] * len(completions)


class CudaMemory(ForgeActor):
    """Spawned on another actor's proc: that process's CUDA caching allocator, in bytes."""

    @endpoint
    async def read(self) -> dict[str, int]:
        import torch

        # non_releasable: free parts of segments that hold a live block, which empty_cache cannot give back
        return dict(
            allocated=torch.cuda.memory_allocated(),
            reserved=torch.cuda.memory_reserved(),
            max_reserved=torch.cuda.max_memory_reserved(),
            non_releasable=torch.cuda.memory_stats().get("inactive_split_bytes.all.current", 0),
        )
