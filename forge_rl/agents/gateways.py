"""Several agent gateways in front of the run's generators (agent.gateway.replicas): each a process of its own
(forge_rl/agents/gateway_client.py) on its own port, all taking the run's one key at their root URLs.

    gateways = await Gateways(model_dir, settings, generator, tokenizer, replicas=2).start()
    episode = await gateways.open(example, trained=True)     # on the gateway with the fewest open episodes
    gateways.base_url(episode)                               # that gateway's http://HOST:PORT/episodes/<id>/v1

An episode lives on one gateway from open to close: its calls, its record and its key are that gateway's (another
gateway refuses the key with 401), and its calls go to one generator replica from there. One gateway's HTTP
parsing, chat rendering and recording run on one core; several spread them over more, and a gateway that dies
costs only its own episodes (named in one line, replaced, as when it is the only one). `AgentRunner`
(forge_rl/agents/rollout.py) takes this as it takes one GatewayClient.
"""

import asyncio
import dataclasses

from forge_rl.agents.access import run_key
from forge_rl.agents.episodes import EpisodeRecord
from forge_rl.agents.gateway_client import GatewayClient, OpenEpisode
from forge_rl.agents.server import EndpointSettings, EndpointStats


class Gateways:
    """The run's gateways: episodes opened on the least loaded, each closed where it was opened."""

    def __init__(self, model_dir, settings: EndpointSettings, generator, tokenizer, write=print, replicas: int = 2):
        key = run_key()  # the run's: every gateway's root URL takes it
        self.members = [
            GatewayClient(
                model_dir,
                # a fixed agent.port is the first gateway's; the others take the ports after it
                dataclasses.replace(settings, port=settings.port + i if settings.port else 0),
                generator,
                tokenizer,
                write,
                key=key,
                name=f"AgentGateway{i}",
            )
            for i in range(replicas)
        ]
        self.run_key, self.tokenizer = key, tokenizer
        self._where: dict[str, GatewayClient] = {}  # an open episode's id -> its gateway

    async def start(self) -> "Gateways":
        try:
            await asyncio.gather(*(gateway.start() for gateway in self.members))
        except BaseException:
            await self.stop()  # nothing of a start that failed is left running
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [gateway.pid for gateway in self.members]

    def base_url(self, episode: OpenEpisode | None = None) -> str:
        """The episode's URL on its gateway; without one, the first gateway's root URL (each takes the run's key)."""
        return self.members[0].base_url() if episode is None else self._where[episode.id].base_url(episode)

    async def open(self, example, trained: bool) -> OpenEpisode:
        gateway = min(self.members, key=lambda g: (not g.healthy, len(g.episodes)))
        episode = await gateway.open(example, trained)
        self._where[episode.id] = gateway
        return episode

    async def close(self, episode: OpenEpisode) -> EpisodeRecord:
        return await self._where.pop(episode.id).close(episode)

    def died(self, episode: OpenEpisode) -> asyncio.Event:
        return self._where[episode.id].died(episode)

    async def call_counts(self) -> tuple[EndpointStats, int]:
        """What the gateways counted, summed, and the calls their open episodes made so far."""
        counts = await asyncio.gather(*(gateway.call_counts() for gateway in self.members))
        total = EndpointStats()
        for stats, _ in counts:
            for field in dataclasses.fields(EndpointStats):
                setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
        return total, sum(calls for _, calls in counts)

    async def stop(self) -> None:
        await asyncio.gather(*(gateway.stop() for gateway in self.members))
        self._where.clear()
