"""Service: N replicas of a ForgeActor, each on its own proc mesh, behind one handle.

    gen = await Generator.options(replicas=2).as_service(cfg)
    group = await gen.generate.route(prompt, n=8)             # one replica, chosen by the routing policy
    group = await gen.generate.route(prompt, session="p17")   # sticky: same replica for the same session
    await gen.update_weights.call_all(version)                # fan out to every healthy replica

Routing: "round_robin" (default) or "least_loaded" (fewest calls in flight). A `session` key pins
calls to one replica while it stays healthy.

Health: a replica whose proc dies is noticed two ways -- Monarch's supervision event for its mesh
(delivered to the controller's fault hook, which forge_rl installs) and a SupervisionError on a call.
Either marks it unhealthy; the health loop then stops its mesh and spawns a fresh replica in its
place. A call that was in flight on the dead replica is retried exactly once on a healthy one (a
second failure propagates). An exception raised by the endpoint itself (ActorError) is the
caller's to handle and is never retried: the actor is still alive.
"""

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from monarch.actor import ProcMesh

from forge_rl.deps.monarch import ActorMesh, EndpointProperty, SupervisionError
from forge_rl.runtime.faults import RoleStartFailed, install_fault_hook, process_lost, replica_owners
from forge_rl.runtime.options import ActorOptions
from forge_rl.runtime.provisioner import get_provisioner, stop_proc_mesh
from forge_rl.runtime.replies import replies

logger = logging.getLogger(__name__)

ROUTING_POLICIES = ("round_robin", "least_loaded")


@dataclass
class Replica:
    index: int
    generation: int = 0  # bumped on every respawn; tells a stale failure report from a fresh one
    mesh: ProcMesh | None = None
    actor: ActorMesh | None = None
    actor_name: str = ""
    healthy: bool = False
    inflight: int = 0
    calls: int = 0


@dataclass
class ServiceStats:
    calls: int = 0
    retries: int = 0
    respawns: int = 0
    failures: list[str] = field(default_factory=list)


class Service:
    def __init__(
        self,
        actor_cls: type,
        args: tuple = (),
        kwargs: dict | None = None,
        opts: ActorOptions | None = None,
        routing: str = "round_robin",
        wait_for_replica_s: float = 300.0,
    ):
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing={routing!r}; choose one of {ROUTING_POLICIES}")
        self.actor_cls, self.args, self.kwargs = actor_cls, args, kwargs or {}
        self.opts = opts or ActorOptions()
        self.name = self.opts.mesh_name or actor_cls.__name__
        self.routing = routing
        self.wait_for_replica_s = wait_for_replica_s
        self.service_stats = ServiceStats()
        self._replicas: list[Replica] = []
        self._rr = itertools.count()
        self._sessions: dict[str, int] = {}
        self._changed = asyncio.Event()  # set whenever a replica becomes healthy
        self._to_respawn: asyncio.Queue[tuple[Replica, int]] = asyncio.Queue()
        self._health_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> "Service":
        self._loop = asyncio.get_running_loop()
        install_fault_hook()
        get_provisioner().register_service(self)
        self._replicas = [Replica(i) for i in range(self.opts.replicas)]
        try:
            await asyncio.gather(*(self._spawn(r) for r in self._replicas))
        except Exception as e:
            lost = process_lost(e)
            if lost is not None:
                raise RoleStartFailed(f"{self.name} replica's", lost) from e
            raise
        self._health_task = asyncio.create_task(self._health_loop(), name=f"{self.name}-health")
        return self

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
        await asyncio.gather(*(self._stop_replica(r) for r in self._replicas))  # replicas stop side by side

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def healthy_replicas(self) -> int:
        return sum(r.healthy for r in self._replicas)

    async def wait_healthy(self, timeout_s: float) -> bool:
        """Wait until every replica is healthy (respawns finished); False if some is not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not all(r.healthy for r in self._replicas):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return False
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
        return True

    def forget_session(self, session: str) -> None:
        """Drop a `session`'s sticky replica (its last call is made): the map holds only sessions in use."""
        self._sessions.pop(session, None)

    def live_replicas(self) -> list[tuple[int, int, Any]]:
        """(index, generation, actor) of each healthy replica, for a role that calls them itself."""
        return [(r.index, r.generation, r.actor) for r in self._replicas if r.healthy]

    def replica_info(self) -> list[dict[str, Any]]:
        return [
            dict(index=r.index, generation=r.generation, healthy=r.healthy, inflight=r.inflight, calls=r.calls)
            for r in self._replicas
        ]

    # ---- calls -----------------------------------------------------------------------------

    def __getattr__(self, name: str) -> "ServiceEndpoint":
        if name.startswith("_") or not isinstance(getattr(self.actor_cls, name, None), EndpointProperty):
            raise AttributeError(f"{self.actor_cls.__name__} has no endpoint {name!r}")
        return ServiceEndpoint(self, name)

    async def route(self, endpoint: str, args: tuple, kwargs: dict, session: str | None = None) -> Any:
        self.service_stats.calls += 1
        replica = await self._pick(session)
        generation = replica.generation
        try:
            return await self._invoke(replica, endpoint, args, kwargs)
        except SupervisionError as e:
            self._mark_dead(replica, generation, f"{endpoint}: {e}")
            self.service_stats.retries += 1
            logger.warning("%s replica %d died during %s; retrying once", self.name, replica.index, endpoint)
            replica = await self._pick(session)
            return await self._invoke(replica, endpoint, args, kwargs)

    async def call_all(self, endpoint: str, args: tuple, kwargs: dict) -> list[Any]:
        """Call every healthy replica; a replica that dies meanwhile is respawned and left out."""
        targets = [(r, r.generation) for r in self._replicas if r.healthy]
        if not targets:
            targets = [(r := await self._pick(None), r.generation)]
        results = await asyncio.gather(
            *(self._invoke(r, endpoint, args, kwargs) for r, _ in targets), return_exceptions=True
        )
        out = []
        for (r, gen), res in zip(targets, results):
            if isinstance(res, SupervisionError):
                self._mark_dead(r, gen, f"{endpoint}: {res}")
            elif isinstance(res, BaseException):
                raise res
            else:
                out.append(res)
        return out

    async def _invoke(self, replica: Replica, endpoint: str, args: tuple, kwargs: dict) -> Any:
        replica.inflight += 1
        replica.calls += 1
        try:
            ep = getattr(replica.actor, endpoint)
            if self.opts.procs == 1:  # the reply over a long-lived port (no per-call leak: runtime/replies.py)
                return await replies().call_named(replica.actor, endpoint, *args, **kwargs)
            return await ep.call(*args, **kwargs)
        finally:
            replica.inflight -= 1

    async def _pick(self, session: str | None) -> Replica:
        deadline = time.monotonic() + self.wait_for_replica_s
        while not (healthy := [r for r in self._replicas if r.healthy]):
            if self._closed:
                raise RuntimeError(f"service {self.name} is shut down")
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"service {self.name}: no healthy replica within {self.wait_for_replica_s:.0f}s "
                    f"(recent failures: {self.service_stats.failures[-3:]})"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=remaining)
        if session is not None:
            idx = self._sessions.get(session)
            if idx is not None and idx < len(self._replicas) and self._replicas[idx].healthy:
                return self._replicas[idx]
        if self.routing == "least_loaded":
            chosen = min(healthy, key=lambda r: (r.inflight, r.calls))
        else:
            chosen = healthy[next(self._rr) % len(healthy)]
        if session is not None:
            self._sessions[session] = chosen.index
        return chosen

    # ---- health ----------------------------------------------------------------------------

    def _mark_dead(self, replica: Replica, generation: int, reason: str) -> None:
        if replica.generation != generation or not replica.healthy or self._closed:
            return  # already handled, or a report about an earlier incarnation
        replica.healthy = False
        self.service_stats.failures.append(f"replica {replica.index}: {reason.splitlines()[0][:200]}")
        self._to_respawn.put_nowait((replica, generation))

    def _on_mesh_failure(self, actor_name: str) -> None:
        """Called (on our loop) for a Monarch supervision event naming one of our actor meshes."""
        for r in self._replicas:
            if r.actor_name.lower() == actor_name:
                self._mark_dead(r, r.generation, "supervision event: proc or actor failed")

    async def _health_loop(self) -> None:
        while not self._closed:
            replica, generation = await self._to_respawn.get()
            if replica.generation != generation or replica not in self._replicas:
                continue
            logger.warning("%s: respawning replica %d", self.name, replica.index)
            await self._stop_replica(replica)
            replica.generation += 1
            try:
                await self._spawn(replica)
                self.service_stats.respawns += 1
            except Exception as e:  # keep the loop alive; try again shortly
                self.service_stats.failures.append(f"respawn of replica {replica.index}: {e}")
                logger.exception("%s: respawn of replica %d failed", self.name, replica.index)
                await asyncio.sleep(1.0)
                self._to_respawn.put_nowait((replica, replica.generation))

    async def _spawn(self, replica: Replica) -> None:
        replica.actor_name = f"{self.name}-r{replica.index}g{replica.generation}"
        replica.mesh = await get_provisioner().get_proc_mesh(
            procs=self.opts.procs,
            gpus=self.opts.gpus,
            mesh_name=replica.actor_name,
            spmd=self.opts.spmd,
            cpus=self.opts.cpus_of(replica.index),
            threads=self.opts.threads,
            share_gpus=self.opts.share_gpus,
            host_mesh=self.opts.host_mesh,
            host_index=replica.index,
            gpu_ids=self.opts.gpu_ids_of(replica.index),
        )
        replica_owners[replica.actor_name.lower()] = self
        replica.actor = replica.mesh.spawn(replica.actor_name, self.actor_cls, *self.args, **self.kwargs)
        await replica.actor.setup.call()
        replica.healthy = True
        self._changed.set()

    async def _stop_replica(self, replica: Replica) -> None:
        replica.healthy = False
        replica_owners.pop(replica.actor_name.lower(), None)
        if replica.mesh is not None:
            mesh, replica.mesh, replica.actor = replica.mesh, None, None
            await stop_proc_mesh(mesh)


class ServiceEndpoint:
    def __init__(self, service: Service, name: str):
        self.service, self.name = service, name

    async def route(self, *args: Any, session: str | None = None, **kwargs: Any) -> Any:
        """Call one replica (by the routing policy, or the `session`'s sticky replica)."""
        return await self.service.route(self.name, args, kwargs, session=session)

    async def call_all(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Call every healthy replica; returns their results in replica order."""
        return await self.service.call_all(self.name, args, kwargs)
