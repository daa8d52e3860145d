"""The run's agent workers, seen from the controller: it hands each episode (the task row, the episode's base URL and
bearer key) to a worker process (forge_rl/agents/worker.py) and takes back its reward, and does none of the agent's
work itself.

    workers = AgentWorkers(cfg.agent, cfg.model, run_key=None, log_dir=log_dir)
    await workers.start()                                      # agent.workers processes, each its own agent
    reward = await workers.run(example, base_url, api_key)     # as AgentEntry.run: a reward, None, or EpisodeFailed
    await workers.close()

`AgentRunner` (forge_rl/agents/rollout.py) takes it in place of an in-process AgentEntry. An episode goes to the
worker with the fewest episodes in flight that has room (`agent.episodes_per_worker`); with none, it waits. A
worker that dies (SIGKILL, the OOM killer, a crash in native code) is named in one line and replaced by a fresh
one; each episode it was playing fails as `agent_worker_lost`, so its group is dropped and counted, never trained
on half-recorded, and no episode is played again elsewhere. A worker that does not answer within
agent.episode_timeout_s plus a grace fails its episode as `agent_timeout`.
"""

import asyncio
import collections
import contextlib
from dataclasses import dataclass
from typing import Any

from forge_rl.agents.config import AgentConfig
from forge_rl.agents.entry import AgentReward, EpisodeFailed
from forge_rl.agents.worker import AgentWorker
from forge_rl.deps.monarch import SupervisionError
from forge_rl.errors import RunStopped
from forge_rl.runtime.actor import respawn, stop_actor
from forge_rl.runtime.faults import why_lost
from forge_rl.runtime.replies import replies

LOST = "agent_worker_lost"
GRACE_S = 30.0  # past agent.episode_timeout_s, a worker that has not answered is given up on
RESPAWN_TRIES = 3
WAIT_FOR_WORKER_S = 300.0  # an episode waits this long at most for a worker to be up again


@dataclass
class WorkerSlot:
    """One worker of the pool: its actor while it runs, and what it is doing."""

    index: int
    generation: int = 0  # bumped on every replacement; tells a stale failure report from a fresh one
    actor: Any = None
    pid: int = 0
    healthy: bool = False
    inflight: int = 0

    @property
    def name(self) -> str:
        return f"AgentWorker-{self.index}" + (f"-{self.generation}" if self.generation else "")


class AgentWorkers:
    """agent.workers AgentWorker processes behind AgentEntry's `run`, each replaced when it dies."""

    fn = None  # no function in this process (AgentRunner looks for one)

    def __init__(self, agent: AgentConfig, model: str, run_key: str | None = None, log_dir=None, write=print):
        self.agent, self.model, self.run_key = agent, model, run_key
        self.log_dir = None if log_dir is None else str(log_dir)
        self.path, self.timeout_s = agent.name, agent.episode_timeout_s
        self.write = write  # where the line naming a lost worker goes
        self.slots = [WorkerSlot(i) for i in range(agent.workers)]
        self.played: collections.Counter[int] = collections.Counter()  # episodes played, by worker pid
        self.lost = 0  # workers lost, ever
        self._changed = asyncio.Event()  # an episode ended or a worker came up
        self._respawns: set[asyncio.Task] = set()
        self._ids = 0
        self._closed = False

    async def start(self) -> "AgentWorkers":
        await asyncio.gather(*(self._spawn(slot) for slot in self.slots))
        return self

    async def _spawn(self, slot: WorkerSlot) -> None:
        slot.actor = await AgentWorker.options(mesh_name=slot.name, host_mesh="agent").as_actor(
            self.agent, self.model, self.run_key, self.log_dir
        )
        slot.pid = await replies().call(slot.actor, AgentWorker.pid)
        slot.healthy, slot.inflight = True, 0
        self._changed.set()

    # ---- episodes --------------------------------------------------------------------------------------------

    async def run(self, example, base_url: str, api_key: str) -> float | AgentReward | None:
        """One episode played by a worker: its reward (None: the run's rewards score it), or EpisodeFailed."""
        slot = await self._pick()
        generation, self._ids = slot.generation, self._ids + 1
        episode = f"w{self._ids}"
        slot.inflight += 1
        try:
            async with asyncio.timeout(self.timeout_s + GRACE_S):
                outcome = await replies().call(slot.actor, AgentWorker.play, episode, example, base_url, api_key)
        except TimeoutError:
            self._cancel(slot, generation, episode)
            raise EpisodeFailed(
                "agent_timeout",
                f"agent {self.path}: worker {slot.index} did not answer within agent.episode_timeout_s="
                f"{self.timeout_s} (+{GRACE_S:.0f} s)",
            ) from None
        except asyncio.CancelledError:  # the group failed elsewhere: the worker stops the episode too
            self._cancel(slot, generation, episode)
            raise
        except SupervisionError as e:
            reason = why_lost(e)
            self._lost(slot, generation, reason)
            raise EpisodeFailed(LOST, f"agent worker {slot.index} died while playing it ({reason})") from None
        except Exception as e:  # an error of the worker's own code (the agent's come back as outcomes)
            failure = getattr(e, "exception", e)
            raise EpisodeFailed(
                "agent_error", f"agent worker {slot.index}: {type(failure).__name__}: {failure}"
            ) from None
        finally:
            if slot.generation == generation:
                slot.inflight -= 1
            self._changed.set()
        self.played[outcome.pid] += 1
        if not outcome.ok:
            raise EpisodeFailed(outcome.reason, outcome.message)
        return outcome.reward if outcome.parts is None else AgentReward(outcome.reward, outcome.parts)

    async def _pick(self) -> WorkerSlot:
        """The healthy worker with the fewest episodes in flight that has room for one more; waits for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_FOR_WORKER_S
        while True:
            if self._closed:
                raise RunStopped("the agent workers are stopped")
            room = [s for s in self.slots if s.healthy and s.inflight < self.agent.episodes_per_worker]
            if room:
                return min(room, key=lambda s: s.inflight)
            if not any(s.healthy for s in self.slots) and not self._respawns:
                raise RunStopped(f"every agent worker died and none could be started again ({self.lost} lost)")
            if loop.time() > deadline:
                raise RunStopped(f"no agent worker had room for an episode within {WAIT_FOR_WORKER_S:.0f} s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=1.0)

    def _cancel(self, slot: WorkerSlot, generation: int, episode: str) -> None:
        if slot.healthy and slot.generation == generation:
            with contextlib.suppress(Exception):
                slot.actor.cancel.broadcast(episode)

    # ---- a worker lost ---------------------------------------------------------------------------------------

    def _lost(self, slot: WorkerSlot, generation: int, reason: str) -> None:
        """Name the worker that died in one line, once, and start another in its place."""
        if slot.generation != generation or not slot.healthy or self._closed:
            return  # already reported, or an earlier worker of this slot
        slot.healthy = False
        self.lost += 1
        self.write(
            f"agent worker {slot.index} (pid {slot.pid}) died ({reason}): its {slot.inflight} episodes in flight "
            f"fail ({LOST}), their groups dropped; starting another"
        )
        task = asyncio.ensure_future(self._replace(slot))
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    async def _replace(self, slot: WorkerSlot) -> None:
        old, slot.actor = slot.actor, None

        async def spawn():
            slot.generation += 1
            await self._spawn(slot)

        if not await respawn(old, spawn, f"agent worker {slot.index}", self.write, RESPAWN_TRIES):
            self._changed.set()

    async def close(self) -> None:
        """Every worker: its agent's resources closed, its process stopped."""
        self._closed = True
        for task in list(self._respawns):
            task.cancel()
        await asyncio.gather(*self._respawns, return_exceptions=True)
        await asyncio.gather(*(self._stop(slot) for slot in self.slots))

    async def _stop(self, slot: WorkerSlot) -> None:
        actor, slot.actor, slot.healthy = slot.actor, None, False
        if actor is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(replies().call(actor, AgentWorker.close), 10)
        with contextlib.suppress(Exception):
            await stop_actor(actor)
