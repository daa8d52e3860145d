"""The agent gateway (forge_rl/agents/gateway.py) seen from the controller: it starts the gateway process, hands
it the generator replicas that run (again whenever one is replaced), opens and closes episodes there, and takes
each closed episode's record back: the controller answers no agent call itself.

    gateway = await GatewayClient(model_dir, settings, generator, tokenizer).start()
    episode = await gateway.open(example, trained=True)     # its id and bearer key
    gateway.base_url(episode)                               # http://HOST:PORT/episodes/<id>/v1
    record = await gateway.close(episode)                   # its calls' exact tokens (EpisodeRecord)
    await gateway.stop()

`AgentRunner` (forge_rl/agents/rollout.py) takes it as it takes an AgentServer in the controller. A gateway that
dies (SIGKILL, the OOM killer) is named in one line and replaced by a fresh one; each episode open on it fails as
`agent_gateway_lost` (its calls' tokens went with the process), so its group is dropped and counted.
"""

import asyncio
import contextlib
from dataclasses import dataclass

from forge_rl.agents.access import run_key
from forge_rl.agents.entry import EpisodeFailed
from forge_rl.agents.episodes import EpisodeRecord
from forge_rl.agents.gateway import AgentGateway
from forge_rl.agents.server import EndpointSettings
from forge_rl.deps.monarch import SupervisionError
from forge_rl.errors import RunStopped
from forge_rl.runtime.actor import respawn, stop_actor
from forge_rl.runtime.faults import why_lost
from forge_rl.runtime.replies import replies

LOST = "agent_gateway_lost"
WATCH_S = 1.0  # how often the replicas the gateway calls are checked against the generator service's
RESPAWN_TRIES = 3
WAIT_FOR_GATEWAY_S = 300.0


@dataclass
class OpenEpisode:
    """An episode open on the gateway: what its agent is given, and which gateway holds its record."""

    id: str
    key: str
    trained: bool
    generation: int


class GatewayClient:
    """The run's gateway process, replaced when it dies."""

    def __init__(
        self, model_dir, settings: EndpointSettings, generator, tokenizer, write=print, key=None, name="AgentGateway"
    ):
        self.model_dir, self.settings, self.generator, self.tokenizer = str(model_dir), settings, generator, tokenizer
        self.write = write  # where the line naming a lost gateway goes
        self.run_key = key or run_key()  # the root URL's key, the same for every gateway of the run
        self.name = name  # its actor mesh's (a run with several gateways names each: forge_rl/agents/gateways.py)
        self.episodes: dict[str, OpenEpisode] = {}
        self.actor, self.root, self.pid = None, "", 0
        self.generation = self.lost = 0
        self.healthy = self._closed = self._gone = False
        self._pushed: list | None = None
        self._up = asyncio.Event()
        self._died: dict[int, asyncio.Event] = {}  # a gateway's generation -> set once it is found dead (a few)
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> "GatewayClient":
        await self._spawn()
        self._keep(self._watch())
        return self

    @property
    def port(self) -> int:
        return int(self.root.rsplit(":", 1)[1].split("/", 1)[0]) if self.root else 0

    def base_url(self, episode: OpenEpisode | None = None) -> str:
        return self.root if episode is None else self.root.replace("/v1", f"/episodes/{episode.id}/v1")

    # ---- episodes --------------------------------------------------------------------------------------------

    async def open(self, example, trained: bool) -> OpenEpisode:
        generation = await self._live()
        try:
            episode_id, key = await replies().call(self.actor, AgentGateway.open_episode, trained)
        except SupervisionError as e:
            self._lost(generation, why_lost(e))
            raise EpisodeFailed(LOST, f"the agent gateway died as the episode opened ({why_lost(e)})") from None
        episode = OpenEpisode(episode_id, key, trained, generation)
        self.episodes[episode_id] = episode
        return episode

    async def close(self, episode: OpenEpisode) -> EpisodeRecord:
        """End the episode and take its record back; EpisodeFailed when the gateway that held it died."""
        self.episodes.pop(episode.id, None)
        record = None
        if episode.generation == self.generation and self.healthy:
            try:
                record = await replies().call(self.actor, AgentGateway.close_episode, episode.id)
            except SupervisionError as e:
                self._lost(episode.generation, why_lost(e))
        if record is None:
            raise EpisodeFailed(LOST, f"episode {episode.id}: the agent gateway holding its calls died")
        return record

    def died(self, episode: OpenEpisode) -> asyncio.Event:
        """Set once the gateway holding `episode` is found dead: its agent's work is lost with it."""
        return self._died.setdefault(episode.generation, asyncio.Event())

    async def call_counts(self) -> tuple:
        """(the gateway's EndpointStats, the calls its open episodes made so far)."""
        return await replies().call(self.actor, AgentGateway.stats)

    async def _live(self) -> int:
        """The generation of the gateway that runs now, once one does."""
        deadline = asyncio.get_running_loop().time() + WAIT_FOR_GATEWAY_S
        while not self.healthy:
            if self._closed or self._gone:
                raise RunStopped(
                    "the agent gateway is stopped" if self._closed else "the agent gateway died and did not start again"
                )
            if asyncio.get_running_loop().time() > deadline:
                raise RunStopped(f"the agent gateway did not start again within {WAIT_FOR_GATEWAY_S:.0f} s")
            self._up.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), timeout=1.0)
        return self.generation

    # ---- the process -----------------------------------------------------------------------------------------

    async def _spawn(self) -> None:
        name = self.name + (f"-{self.generation}" if self.generation else "")
        # episode ids unique in the run: which gateway ("1" of several), which of its processes ("r2": replaced twice)
        prefix = self._which().strip() + (f"r{self.generation}" if self.generation else "")
        actor = await AgentGateway.options(mesh_name=name, host_mesh="agent").as_actor(
            self.model_dir, self.settings, self.run_key, f"{prefix}-" if prefix else ""
        )
        self.root, self.pid = await replies().call(actor, AgentGateway.address)
        self._pushed = None
        await self._push(actor)
        self.actor, self.healthy = actor, True
        self._up.set()

    async def _push(self, actor) -> None:
        """Hand the gateway the replicas that run, when they changed since it last heard."""
        live = self.generator.live_replicas()
        seen = [(index, generation) for index, generation, _ in live]
        if seen != self._pushed:
            await replies().call(actor, AgentGateway.update_replicas, live)
            self._pushed = seen

    async def _watch(self) -> None:
        """Every WATCH_S: the gateway still answers, and has the replicas that run now."""
        while not self._closed:
            await asyncio.sleep(WATCH_S)
            if self.healthy:
                generation = self.generation
                try:
                    await replies().call(self.actor, AgentGateway.alive)
                    await self._push(self.actor)
                except SupervisionError as e:
                    self._lost(generation, why_lost(e))

    def _lost(self, generation: int, reason: str) -> None:
        """Name the gateway that died in one line, once, and start another in its place."""
        if generation != self.generation or not self.healthy or self._closed:
            return  # already reported
        self.healthy, self.lost = False, self.lost + 1
        self._died.setdefault(generation, asyncio.Event()).set()
        open_here = sum(e.generation == generation for e in self.episodes.values())
        self.write(
            f"agent gateway{self._which()} (pid {self.pid}) died ({reason}): its {open_here} open episodes fail "
            f"({LOST}), their groups dropped; starting another"
        )
        self._keep(self._replace())

    def _which(self) -> str:
        """The gateway's number among several with a space before it (AgentGateway2: " 2"); "" for a run's only one."""
        return f" {self.name.removeprefix('AgentGateway')}" if self.name != "AgentGateway" else ""

    async def _replace(self) -> None:
        old, self.actor = self.actor, None

        async def spawn():
            self.generation += 1
            await self._spawn()

        if not await respawn(old, spawn, "agent gateway", self.write, RESPAWN_TRIES):
            self._gone = True

    def _keep(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Stop the gateway: its port released, its process ended (idempotent)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        actor, self.actor, self.healthy = self.actor, None, False
        self.episodes.clear()
        if actor is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(replies().call(actor, AgentGateway.close), 10)
        with contextlib.suppress(Exception):
            await stop_actor(actor)
