"""Service routing and recovery on real Monarch procs."""

import asyncio
import os
import signal
import time

import psutil
import pytest
from monarch.actor import ActorError

from forge_rl.runtime import Service, provisioned
from forge_rl.runtime.options import ActorOptions
from tests.support.actors import Echo
from tests.conftest import run


async def until(condition, what: str, timeout_s: float = 30) -> None:
    """Poll `condition()` (the service's own state, no actor call) until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        await asyncio.sleep(0.01)


def in_flight(svc: Service) -> bool:
    return any(r["inflight"] for r in svc.replica_info())


async def two_replicas(routing="round_robin") -> Service:
    return await Service(Echo, ("svc",), opts=ActorOptions(replicas=2), routing=routing).start()


def watchers_of_this_process() -> set[int]:
    """The reaper processes watching this process (forge_rl/runtime/reaper.py): a run's provisioner starts one and
    ends it when the run shuts down."""
    me = str(os.getpid())
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if any(arg.endswith("reaper.py") for arg in cmdline) and me in cmdline:
            found.add(p.pid)
    return found


def test_round_robin_call_all_and_sticky_sessions():
    """...and the run's end leaves no provisioner behind: its service stopping its replicas starts no new one (whose
    watcher would then live as long as this process)."""
    from forge_rl.runtime import provisioner

    before = watchers_of_this_process()

    async def body():
        async with provisioned():
            svc = await two_replicas()
            assert svc.num_replicas == svc.healthy_replicas == 2
            pids = [(await svc.who.route())[1] for _ in range(6)]
            assert len(set(pids)) == 2 and pids[0::2] == [pids[0]] * 3 and pids[1::2] == [pids[1]] * 3
            assert sorted(p for _, p in await svc.who.call_all()) == sorted(set(pids))
            sticky = {(await svc.who.route(session="prompt-7"))[1] for _ in range(5)}
            assert len(sticky) == 1

    run(body())
    assert provisioner._provisioner is None and watchers_of_this_process() == before


def test_least_loaded_avoids_the_busy_replica():
    async def body():
        async with provisioned():
            svc = await two_replicas("least_loaded")
            slow = asyncio.ensure_future(svc.who.route(1.5))
            await until(lambda: in_flight(svc), "a call in flight")
            busy_index = next(r["index"] for r in svc.replica_info() if r["inflight"])
            quick = {(await svc.who.route())[1] for _ in range(4)}
            _, busy_pid = await slow
            assert busy_pid not in quick and len(quick) == 1
            assert svc.replica_info()[busy_index]["calls"] == 1

    run(body())


def test_killed_replica_is_replaced_and_inflight_call_retried_once():
    async def body():
        async with provisioned():
            svc = await two_replicas()
            _, victim = await svc.who.route(session="s")
            call = asyncio.ensure_future(svc.who.route(3.0, session="s"))
            await until(lambda: in_flight(svc), "a call in flight")
            os.kill(victim, signal.SIGKILL)
            tag, pid = await call
            assert tag == "svc" and pid != victim  # answered by a healthy replica
            assert svc.service_stats.retries == 1
            # the health loop respawns the dead replica
            await until(lambda: svc.healthy_replicas == 2 and svc.service_stats.respawns == 1, "respawned")
            assert svc.healthy_replicas == 2 and svc.service_stats.respawns == 1
            assert max(r["generation"] for r in svc.replica_info()) == 1
            pids = {p for _, p in await svc.who.call_all()}
            assert len(pids) == 2 and victim not in pids

    run(body())


def test_single_replica_retry_waits_for_the_respawn():
    async def body():
        async with provisioned():
            svc = await Service(Echo, ("solo",), opts=ActorOptions(replicas=1)).start()
            _, victim = await svc.who.route()
            call = asyncio.ensure_future(svc.who.route(3.0))
            await until(lambda: in_flight(svc), "a call in flight")
            os.kill(victim, signal.SIGKILL)
            _, pid = await call
            assert pid != victim and svc.service_stats.respawns == 1

    run(body())


def test_endpoint_exception_is_not_retried_and_replica_stays():
    async def body():
        async with provisioned():
            svc = await two_replicas()
            with pytest.raises(ActorError, match="endpoint raised on purpose"):
                await svc.fail.route()
            assert svc.service_stats.retries == 0 and svc.healthy_replicas == 2
            with pytest.raises(AttributeError, match="Echo has no endpoint 'nope'"):
                svc.nope  # noqa: B018 (the attribute's lookup is what raises)

    run(body())


def test_as_service_and_as_actor_via_options():
    async def body():
        async with provisioned():
            svc = await Echo.options(replicas=2, mesh_name="gen").as_service("opt")
            assert svc.name == "gen" and svc.num_replicas == 2
            actor = await Echo.options(procs=2).as_actor("mesh")
            values = await actor.who.call()
            assert len({pid for _, (_, pid) in values.items()}) == 2
            with pytest.raises(ValueError, match="procs must be >= 1"):
                Echo.options(procs=0)

    run(body())
