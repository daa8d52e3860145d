"""The gateway's way to the generator replicas (forge_rl/agents/gateway.py): every call of one episode goes to the
same replica, so the engine's prefix cache holds the episode's earlier turns when its next call comes.

    replicas = StickyReplicas()
    replicas.update([(0, 0, actor0), (1, 0, actor1)])           # the live replicas, as the controller sees them
    completions = await replicas.generate.route(ids, session="t3", n=1, max_tokens=8)
    replicas.forget_session("t3")                              # the episode ended: {the replicas it used}

An episode's first call goes to the replica with the fewest episodes open on it (then the fewest calls in flight);
its later calls follow. A call without an episode (the root URL) goes to the replica with the fewest calls in
flight. A replica whose process died (a SupervisionError) is left out until the controller hands over its
replacement (`update`, with a newer generation); the call is made once more on another live replica, and the
episode stays there.
"""

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from forge_rl.deps.monarch import SupervisionError
from forge_rl.runtime.replies import replies

WAIT_FOR_REPLICA_S = 300.0


class NoReplica(RuntimeError):
    """No generator replica was live within WAIT_FOR_REPLICA_S."""


@dataclass
class Replica:
    index: int
    generation: int
    actor: Any
    live: bool = True
    sessions: int = 0  # episodes whose calls go here
    inflight: int = 0
    calls: int = 0


@dataclass
class StickyReplicas:
    replicas: dict[int, Replica] = field(default_factory=dict)
    sessions: dict[str, int] = field(default_factory=dict)  # an open episode -> its replica
    served: dict[str, set[int]] = field(default_factory=dict)  # an open episode -> the replicas its calls went to
    wait_s: float = WAIT_FOR_REPLICA_S
    lost: int = 0  # replicas found dead by a call

    def __post_init__(self) -> None:
        self._changed = asyncio.Event()

    @property
    def generate(self) -> "_Endpoint":
        return _Endpoint(self, "generate")

    def update(self, live: list[tuple[int, int, Any]]) -> None:
        """The replicas that run now, as (index, generation, actor): a new generation replaces a dead replica."""
        for index, generation, actor in live:
            known = self.replicas.get(index)
            if known is None or known.generation != generation:
                self.replicas[index] = Replica(index, generation, actor, sessions=known.sessions if known else 0)
        for index in set(self.replicas) - {i for i, _, _ in live}:
            self.replicas[index].live = False
        self._changed.set()

    def forget_session(self, session: str) -> set[int]:
        """An episode ended: its replica is free for others. The replicas its calls went to."""
        index = self.sessions.pop(session, None)
        if index is not None and index in self.replicas:
            self.replicas[index].sessions -= 1
        return self.served.pop(session, set())

    async def route(self, endpoint: str, args: tuple, kwargs: dict, session: str | None = None) -> Any:
        replica = await self._pick(session)
        try:
            return await self._invoke(replica, endpoint, args, kwargs, session)
        except SupervisionError:
            self._dead(replica)
            return await self._invoke(await self._pick(session), endpoint, args, kwargs, session)

    async def _invoke(self, replica: Replica, endpoint: str, args: tuple, kwargs: dict, session: str | None):
        replica.inflight += 1
        replica.calls += 1
        if session is not None:
            self.served.setdefault(session, set()).add(replica.index)
        try:
            return await replies().call_named(replica.actor, endpoint, *args, **kwargs)
        finally:
            replica.inflight -= 1

    async def _pick(self, session: str | None) -> Replica:
        deadline = time.monotonic() + self.wait_s
        while not (live := [r for r in self.replicas.values() if r.live]):
            if time.monotonic() > deadline:
                raise NoReplica(f"no generator replica was running within {self.wait_s:.0f} s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        if session is None:
            return min(live, key=lambda r: (r.inflight, r.index))
        index = self.sessions.get(session)
        if index is not None and self.replicas[index].live:
            return self.replicas[index]
        if index is not None:
            self.replicas[index].sessions -= 1
        chosen = min(live, key=lambda r: (r.sessions, r.inflight, r.index))
        chosen.sessions += 1
        self.sessions[session] = chosen.index
        return chosen

    def _dead(self, replica: Replica) -> None:
        current = self.replicas.get(replica.index)
        if current is replica and replica.live:
            replica.live = False
            self.lost += 1


class _Endpoint:
    """`replicas.generate`: called as a Service's endpoint is (`route`), so the endpoint takes either."""

    def __init__(self, replicas: StickyReplicas, name: str):
        self.replicas, self.name = replicas, name

    async def route(self, *args: Any, session: str | None = None, **kwargs: Any) -> Any:
        return await self.replicas.route(self.name, args, kwargs, session=session)
