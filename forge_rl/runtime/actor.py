"""ForgeActor: a Monarch actor that knows how to bring itself up, alone or as a replicated service.

    class Reward(ForgeActor):
        @endpoint
        async def score(self, group): ...

    reward = await Reward.as_actor(weights=[1.0])                      # one mesh, default options
    gen = await Generator.options(procs=1, replicas=2).as_service(cfg)  # N replicas, see Service

Endpoints of a ForgeActor are `async def` (Monarch refuses actors that mix sync and async
endpoints, and the base class defines `setup` as async). Blocking work inside an endpoint is fine;
wrap it in `asyncio.to_thread` when the actor must stay responsive meanwhile.
"""

import asyncio
import contextlib
from dataclasses import replace
from typing import Any, TypeVar

from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.deps.monarch import ActorMesh
from forge_rl.runtime.faults import RoleStartFailed, process_lost
from forge_rl.runtime.options import ActorOptions
from forge_rl.runtime.provisioner import get_provisioner, stop_proc_mesh
from forge_rl.runtime.replies import run_and_reply
from forge_rl.runtime.service import Service

A = TypeVar("A", bound="ForgeActor")


class ForgeActor(Actor):
    @endpoint
    async def setup(self) -> None:
        """Runs once after spawn, before the actor is handed out. Override for slow init (engines)."""

    # Calls whose reply comes back over a long-lived port (forge_rl/runtime/replies.py): the caller picks
    # the concurrent relay exactly when the endpoint it names is a concurrent endpoint.
    @endpoint
    async def reply_to(self, port, request: int, endpoint: str, args: tuple, kwargs: dict) -> None:
        await run_and_reply(self, port, request, endpoint, args, kwargs)

    @concurrent_endpoint
    async def reply_to_concurrently(self, port, request: int, endpoint: str, args: tuple, kwargs: dict) -> None:
        await run_and_reply(self, port, request, endpoint, args, kwargs)

    @concurrent_endpoint
    async def alive(self) -> bool:
        return True

    @classmethod
    def options(cls: type[A], **kwargs: Any) -> "_Launcher[A]":
        return _Launcher(cls, ActorOptions(**kwargs))

    @classmethod
    async def as_actor(cls: type[A], *args: Any, **kwargs: Any) -> ActorMesh[A]:
        return await _Launcher(cls, ActorOptions()).as_actor(*args, **kwargs)

    @classmethod
    async def as_service(cls: type[A], *args: Any, **kwargs: Any):
        return await _Launcher(cls, ActorOptions()).as_service(*args, **kwargs)


class _Launcher:
    """What `ForgeActor.options(...)` returns: the class plus where and how to run it."""

    def __init__(self, cls: type, opts: ActorOptions):
        self.cls, self.opts = cls, opts

    def options(self, **kwargs: Any) -> "_Launcher":
        return _Launcher(self.cls, replace(self.opts, **kwargs))

    async def as_actor(self, *args: Any, **kwargs: Any) -> ActorMesh:
        """Spawn on one new proc mesh, run `setup` on every rank, return the actor mesh."""
        name = self.opts.mesh_name or self.cls.__name__
        mesh = await get_provisioner().get_proc_mesh(
            procs=self.opts.procs,
            gpus=self.opts.gpus,
            mesh_name=name,
            spmd=self.opts.spmd,
            cpus=self.opts.cpus_of(0),
            threads=self.opts.threads,
            share_gpus=self.opts.share_gpus,
            host_mesh=self.opts.host_mesh,
            gpu_ids=self.opts.gpu_ids_of(0),
        )
        try:
            actor = mesh.spawn(name, self.cls, *args, **kwargs)
            await actor.setup.call()
        except BaseException as e:
            await stop_proc_mesh(mesh)  # a failed setup must not leave its procs running
            lost = process_lost(e)
            if lost is not None:
                raise RoleStartFailed(name, lost) from e
            raise
        actor._forge_proc_mesh = mesh  # so callers can stop it: await stop_actor(actor)
        return actor

    async def as_service(self, *args: Any, **kwargs: Any):
        service = Service(self.cls, args, kwargs, self.opts)
        await service.start()
        return service


async def stop_actor(actor: ActorMesh) -> None:
    """Stop an actor made by `as_actor` and its proc mesh."""
    await stop_proc_mesh(actor._forge_proc_mesh)


async def respawn(old: ActorMesh | None, spawn, name: str, write, tries: int = 3, wait_s: float = 2.0) -> bool:
    """Replace a dead actor: stop `old` (what stopping a dead one raises is moot), then `await spawn()` up to `tries`
    times, a line naming `name` for each try that fails. Returns whether one started."""
    if old is not None:
        with contextlib.suppress(Exception):
            await stop_actor(old)
    for attempt in range(1, tries + 1):
        try:
            await spawn()
            return True
        except Exception as e:
            line = str(getattr(e, "exception", e)).strip().splitlines()
            write(f"{name} did not start again (try {attempt}): {(line or ['?'])[-1][:300]}")
            await asyncio.sleep(wait_s)
    return False
