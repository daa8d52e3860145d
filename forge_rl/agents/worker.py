"""The agent-worker actor: a process of its own that plays the run's agent episodes, so that the agent's code, its
client and its threads never share the controller's core and event loop.

    worker = await AgentWorker.options(mesh_name="AgentWorker-0").as_actor(cfg.agent, cfg.model, None, log_dir)
    outcome = await replies().call(worker, AgentWorker.play, "w3", example, base_url, api_key)

Each worker builds the run's agent once (`agent_entry`: agent.entry's function, agent.command's program, or a
verifiers environment's episodes) and runs at most `agent.episodes_per_worker` episodes at once in its own event
loop (a sync agent in threads of its own), each under agent.episode_timeout_s. It gets only what an episode needs:
the task row, the episode's base URL and its bearer key (forge_rl/agents/access.py); every call of the episode goes
to the run's endpoint, which records it. `play` never raises for the agent's failures: it returns an `Outcome`,
so a failure crosses the process boundary as the reason and line it is. The controller's side, which hands out
episodes and replaces a worker that dies, is forge_rl/agents/workers.py.
"""

import asyncio
import os
from typing import NamedTuple

from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.agents.config import AgentConfig
from forge_rl.agents.entry import AgentReward, EpisodeFailed
from forge_rl.agents.factory import agent_entry
from forge_rl.runtime import ForgeActor
from forge_rl.runtime.reaper import reap_descendants_on_exit


class Outcome(NamedTuple):
    """An episode as a worker played it: its reward (None: the run's rewards score it) and the reward's parts, or
    the failure's reason and one-line message; `pid`, the worker's process."""

    ok: bool
    reward: float | None = None
    parts: dict | None = None
    reason: str = ""
    message: str = ""
    pid: int = 0


class AgentWorker(ForgeActor):
    """Plays episodes of the run's agent, at most `agent.episodes_per_worker` at once."""

    def __init__(self, agent: AgentConfig, model: str, run_key: str | None = None, log_dir: str | None = None):
        self.agent, self.model, self.run_key, self.log_dir = agent, model, run_key, log_dir
        self.entry = self._reaper = None
        self.running: dict[str, asyncio.Task] = {}

    @endpoint
    async def setup(self) -> None:
        # what the agent starts (agent.command's programs, in sessions of their own) is stopped when this process
        # dies, however it dies: a SIGKILLed worker leaves nothing running
        self._reaper = reap_descendants_on_exit()
        self.entry = agent_entry(self.agent, self.model, self.log_dir)
        # an agent whose episodes share one client of the root URL (verifiers') calls it with the run's key
        if self.run_key is not None and (use_run_key := getattr(self.entry.fn, "use_run_key", None)) is not None:
            use_run_key(self.run_key)
        self.slots = asyncio.Semaphore(self.agent.episodes_per_worker)

    @concurrent_endpoint
    async def play(self, episode: str, example, base_url: str, api_key: str) -> Outcome:
        """One episode of `example` against its base URL and key: its Outcome. Cancelled (`cancel`), it ends as
        an agent_cancelled failure."""
        async with self.slots:
            task = asyncio.ensure_future(self.entry.run(example, base_url, api_key))
            self.running[episode] = task
            try:
                result = await task
            except EpisodeFailed as e:
                return Outcome(False, reason=e.reason, message=str(e), pid=os.getpid())
            except asyncio.CancelledError:
                return Outcome(False, reason="agent_cancelled", message="cancelled", pid=os.getpid())
            except Exception as e:  # the worker's own code, never the agent's (AgentEntry names those)
                return Outcome(False, reason="agent_error", message=f"{type(e).__name__}: {e}", pid=os.getpid())
            finally:
                self.running.pop(episode, None)
        if isinstance(result, AgentReward):
            return Outcome(True, result.value, dict(result.parts), pid=os.getpid())
        return Outcome(True, result, pid=os.getpid())

    @concurrent_endpoint
    async def cancel(self, episode: str) -> None:
        """Stop an episode the controller gave up on (its group failed elsewhere): its slot is freed at once."""
        if (task := self.running.get(episode)) is not None:
            task.cancel()

    @concurrent_endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def close(self) -> None:
        """The agent's own resources: its connection pool, its threads, verifiers' serving."""
        if self.entry is not None:
            await self.entry.close()
        if self._reaper is not None:  # nothing left to watch
            self._reaper.terminate()
            self._reaper.wait()
