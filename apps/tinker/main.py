"""A Tinker-compatible service on forge_rl's trainer and generator, for the `tinker` client and tinker-cookbook.

    python -m apps.tinker.main --config configs/tinker/tiny.yaml [key=value ...]

It prints its base URL and API key, then serves until Ctrl-C (forge_rl/tinker/service.py; docs/tinker.md).
"""

import asyncio

from forge_rl.recipes.command_line import main_process
from forge_rl.tinker.config import TinkerConfig


async def main(cfg: TinkerConfig) -> dict:
    from forge_rl.tinker.service import TinkerService  # here: a config error is found before torch is imported

    async with TinkerService(cfg) as service:
        service.announce()
        await asyncio.Event().wait()  # until Ctrl-C or SIGTERM
    return {}


if __name__ == "__main__":
    main_process(TinkerConfig, main, __doc__.splitlines()[0])
