"""Spawned by tests/integration/test_shutdown.py: start a service and an actor, then leave in the way argv[1] says."""

import asyncio
import os
import sys

from forge_rl.runtime import provisioned
from forge_rl.weights.runs import RUN_ID_ENV
from forge_rl.launch.signals import handle_stop_signals
from tests.support.actors import ShmWriter


async def main(how: str) -> None:
    async with provisioned():
        print("RUN", os.environ[RUN_ID_ENV], flush=True)  # the test checks this run's /dev/shm entries only
        svc = await ShmWriter.options(replicas=2).as_service()
        actor = await ShmWriter.as_actor()
        infos = await svc.info.call_all() + [await actor.info.call_one()]
        print("PIDS", " ".join(str(pid) for pid, _ in infos), flush=True)
        print("SHM", " ".join(path for _, path in infos), flush=True)
        if how == "exception":
            raise RuntimeError("controller failed on purpose")
        if how == "sigkill":
            children = [await actor.start_child.call_one()] + await svc.start_child.call_all()
            print("CHILDREN", " ".join(str(pid) for pid in children), flush=True)
        if how in ("sigint", "sigterm", "sigkill"):
            print("READY", flush=True)
            await asyncio.sleep(120)


if __name__ == "__main__":
    handle_stop_signals()  # the test sends SIGINT; this process may have inherited it ignored
    asyncio.run(main(sys.argv[1]))
