"""The gateway's routing to the generator replicas (forge_rl/agents/routing.py): each episode's calls go to one
replica, episodes spread over the replicas, and a replica whose process died is left for another until the
controller hands over its replacement. The replicas here are plain objects answering `generate` as a Generator's
endpoint would be called (`generate.call_one`), so no engine is needed."""

import asyncio

from forge_rl.agents.routing import StickyReplicas
from forge_rl.deps.monarch import SupervisionError


class Engine:
    """A replica that answers with its own index, or dies (SupervisionError) once told to."""

    def __init__(self, index: int):
        self.index, self.dead, self.calls = index, False, 0
        self.generate = self

    async def call_one(self, prompt, **kwargs):
        await asyncio.sleep(0)
        if self.dead:
            raise SupervisionError(f"replica {self.index}: the process failed: Killed(sig=9)")
        self.calls += 1
        return self.index


def test_each_episode_keeps_one_replica_and_episodes_spread():
    engines = [Engine(0), Engine(1)]
    replicas = StickyReplicas()
    replicas.update([(e.index, 0, e) for e in engines])

    async def episode(name: str) -> set[int]:
        return {await replicas.generate.route([1, 2], session=name, n=1) for _ in range(3)}

    async def run():
        return await asyncio.gather(*(episode(f"t{i}") for i in range(6)))

    served = asyncio.run(run())
    assert all(len(s) == 1 for s in served)  # every call of an episode on the same replica
    assert sorted(next(iter(s)) for s in served) == [0, 0, 0, 1, 1, 1]  # three episodes on each
    assert replicas.forget_session("t0") == served[0] and "t0" not in replicas.sessions
    assert sum(r.sessions for r in replicas.replicas.values()) == 5


def test_a_dead_replica_is_left_for_another_until_it_is_replaced():
    engines = [Engine(0), Engine(1)]
    replicas = StickyReplicas()
    replicas.update([(e.index, 0, e) for e in engines])

    async def run():
        first = await replicas.generate.route([1], session="a")
        engines[first].dead = True
        again = await replicas.generate.route([1], session="a")  # retried once on the other replica
        later = await replicas.generate.route([1], session="a")
        fresh = Engine(first)  # the controller's replacement for the dead one: a new generation
        replicas.update([(fresh.index, 1, fresh), (1 - first, 0, engines[1 - first])])
        other = await replicas.generate.route([1], session="b")  # the replica with fewer episodes: the new one
        return first, again, later, other, fresh

    first, again, later, other, fresh = asyncio.run(run())
    assert again == later == 1 - first and replicas.lost == 1
    assert replicas.forget_session("a") == {first, 1 - first}  # the episode's calls went to both
    assert other == first and fresh.calls == 1


def test_with_no_replica_a_call_waits_then_fails_in_one_line():
    replicas = StickyReplicas(wait_s=0.2)

    async def run():
        try:
            await replicas.generate.route([1], session="a")
        except RuntimeError as e:
            return str(e)

    said = asyncio.run(run())
    assert said == "no generator replica was running within 0 s"
