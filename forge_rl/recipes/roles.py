"""The run's roles as one typed value: every actor that start-up made, each handle with the actor class it runs;
a trainer-like role as its ranks, each with the data-parallel shard it trains on (forge_rl/loop/ranks.py).

    roles = await startup.start_actors(run, hosts, gpus)        # forge_rl/recipes/startup.py
    await calls.call(roles.buffer, ReplayBuffer.add, group)     # the loop reads its actors from it
    for rank, sent in roles.trainer.sending(batches): ...       # rank: ActorMesh[Trainer], one rank

Start-up returns it, the run holds it (`run.roles`), and the loop's stages take it: no handle is assigned onto a
run from elsewhere, and what a run has started is in one place. An algorithm that starts a role more (PPO's
critic) returns a new value with it (`with_role`).
"""

from dataclasses import dataclass, replace

from forge_rl.actors.critic import Critic
from forge_rl.actors.dataset import PromptDataset
from forge_rl.actors.reference import Reference
from forge_rl.actors.replay_buffer import ReplayBuffer
from forge_rl.actors.reward import RewardActor
from forge_rl.actors.trainer import Trainer
from forge_rl.deps.monarch import ActorMesh
from forge_rl.loop.ranks import Ranks
from forge_rl.runtime.service import Service


@dataclass(frozen=True)
class Roles:
    trainer: Ranks[Trainer]  # dp x tp ranks, every one called for a step
    generator: Service  # Generator replicas, vLLM inside each (forge_rl/actors/generator.py)
    buffer: ActorMesh[ReplayBuffer]
    reward: ActorMesh[RewardActor]
    dataset: ActorMesh[PromptDataset]
    reference: Ranks[Reference] | None = None  # the KL reference, or a distillation's teacher
    critic: Ranks[Critic] | None = None  # PPO's value model, on ranks of its own

    def with_role(self, name: str, role: Ranks | ActorMesh) -> "Roles":
        """These roles and `role` as role `name` (a field above)."""
        return replace(self, **{name: role})
