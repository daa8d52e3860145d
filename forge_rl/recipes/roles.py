"""The run's roles as one typed value: every actor that start-up made, each handle with the actor class it runs, and
each trainer-like role's data-parallel shards.

    roles = await startup.start_actors(run, hosts, gpus)        # forge_rl/recipes/startup.py
    await calls.call(roles.buffer, ReplayBuffer.add, group)     # the loop reads its actors from it

Start-up returns it, the run holds it (`run.roles`), and the loop's stages take it: no handle is assigned onto a
run from elsewhere, and what a run has started is in one place. An algorithm that starts a role more (PPO's
critic) returns a new value with it (`with_role`).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from forge_rl.actors.critic import Critic
from forge_rl.actors.dataset import PromptDataset
from forge_rl.actors.reference import Reference
from forge_rl.actors.replay_buffer import ReplayBuffer
from forge_rl.actors.reward import RewardActor
from forge_rl.actors.trainer import Trainer
from forge_rl.deps.monarch import ActorMesh
from forge_rl.runtime.service import Service


@dataclass(frozen=True)
class Roles:
    trainer: ActorMesh[Trainer]  # dp x tp ranks (every endpoint called on each rank: call_each_rank)
    generator: Service  # Generator replicas, vLLM inside each (forge_rl/actors/generator.py)
    buffer: ActorMesh[ReplayBuffer]
    reward: ActorMesh[RewardActor]
    dataset: ActorMesh[PromptDataset]
    reference: ActorMesh[Reference] | None = None  # the KL reference, or a distillation's teacher
    critic: ActorMesh[Critic] | None = None  # PPO's value model, on ranks of its own
    # role -> the data-parallel shard (the index of the batch it trains on) of each of its ranks, in rank order
    shards: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def with_role(self, name: str, actor: ActorMesh, shards: list[int] | None = None) -> "Roles":
        """These roles and `actor` as role `name` (a field above), with its ranks' shards when it trains."""
        more = {name: tuple(shards)} if shards is not None else {}
        return replace(self, **{name: actor}, shards={**self.shards, **more})
