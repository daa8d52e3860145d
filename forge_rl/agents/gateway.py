"""The agent gateway: the run's OpenAI-compatible endpoint (forge_rl/agents/server.py) served from a process of its
own in front of the generator replicas, so that no agent call is answered by the controller's event loop.

    gateway = await AgentGateway.options(mesh_name="AgentGateway").as_actor(model_dir, settings, run_key)
    await replies().call(gateway, AgentGateway.update_replicas, generator.live_replicas())
    episode_id, key = await replies().call(gateway, AgentGateway.open_episode, True)
    ...                                                # the agent calls http://HOST:PORT/episodes/<id>/v1
    record = await replies().call(gateway, AgentGateway.close_episode, episode_id)

It keeps every open episode's record of exact tokens (forge_rl/agents/episodes.py) and hands each over once, when
the controller closes the episode: one actor call per episode, never one per call of the agent. Each episode's
calls go to one generator replica (forge_rl/agents/routing.py). It listens on agent.gateway.host:agent.port, and
takes the keys the endpoint takes (forge_rl/agents/access.py). The controller's side, which starts it, hands it
the live replicas, and names it in one line if it dies, is forge_rl/agents/gateway_client.py.
"""

import os

from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.agents.episodes import EpisodeRecord
from forge_rl.agents.routing import StickyReplicas
from forge_rl.agents.server import AgentServer, EndpointSettings, EndpointStats
from forge_rl.runtime import ForgeActor


class AgentGateway(ForgeActor):
    """The endpoint of one run, in its own process."""

    def __init__(self, model_dir: str, settings: EndpointSettings, run_key: str, id_prefix: str = ""):
        self.model_dir, self.settings, self.run_key, self.id_prefix = model_dir, settings, run_key, id_prefix
        self.server: AgentServer | None = None
        self.replicas = StickyReplicas()

    @endpoint
    async def setup(self) -> None:
        from forge_rl.models import load_tokenizer

        tokenizer = load_tokenizer(self.model_dir)
        self.server = AgentServer(tokenizer, self.replicas, self.settings, self.run_key, self.id_prefix)
        await self.server.start()

    @concurrent_endpoint
    async def address(self) -> tuple[str, int]:
        """(the root URL, this process's pid)."""
        return self.server.base_url(), os.getpid()

    @concurrent_endpoint
    async def update_replicas(self, live: list) -> None:
        """The generator replicas that run now, as (index, generation, actor) (the controller's Service's)."""
        self.replicas.update(live)

    @concurrent_endpoint
    async def open_episode(self, trained: bool) -> tuple[str, str]:
        """A new episode: (its id, its bearer key)."""
        record = self.server.open_episode(None, trained)
        return record.id, record.key

    @concurrent_endpoint
    async def close_episode(self, episode_id: str) -> EpisodeRecord | None:
        """End an episode (later calls to it are refused) and hand over its record; None if it is not open."""
        record = self.server.episodes.get(episode_id)
        if record is None:
            return None
        self.server.close_episode(record)
        return record

    @concurrent_endpoint
    async def stats(self) -> tuple[EndpointStats, int]:
        """What the endpoint counted, and the calls its open episodes made so far."""
        return self.server.stats, sum(r.calls for r in self.server.episodes.values())

    @endpoint
    async def close(self) -> None:
        """Stop serving: the port released."""
        if self.server is not None:
            await self.server.stop()
