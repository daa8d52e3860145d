"""A Tinker-compatible service on forge_rl's trainer and generator, for the `tinker` client and tinker-cookbook.

    python -m apps.tinker.main --config configs/tinker/tiny.yaml [key=value ...]

It prints its base URL and API key, then serves until Ctrl-C (forge_rl/tinker/service.py; docs/tinker.md).
"""

import asyncio
import contextlib
import os

from forge_rl.recipes.command_line import main_process
from forge_rl.tinker.config import TinkerConfig


async def main(cfg: TinkerConfig) -> dict:
    from forge_rl.tinker.service import TinkerService  # here: a config error is found before torch is imported

    with profiled(os.environ.get("FORGE_RL_TINKER_PROFILE")):
        async with TinkerService(cfg) as service:
            service.announce()
            await asyncio.Event().wait()  # until Ctrl-C or SIGTERM
    return {}


@contextlib.contextmanager
def profiled(path: str | None):
    """With FORGE_RL_TINKER_PROFILE=path, the service's event loop (HTTP, bodies, futures) under cProfile, its
    stats written to `path` when it stops (benchmarks/tinker_profile.py reads them)."""
    if not path:
        yield
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(path)


if __name__ == "__main__":
    main_process(TinkerConfig, main, __doc__.splitlines()[0])
