"""A trainer-like role's ranks as typed handles, each with the data-parallel shard it trains on.

    trainer = await Ranks.of(trainer_mesh)                      # a Trainer, Critic or Reference mesh
    metrics = await asyncio.gather(*(rank.step.call_one(sent, version) for rank, sent in trainer.sending(batches)))
    await trainer.mesh.save.call(step, path)                    # every rank at once, one call

Each rank is its own typed handle (`ActorMesh[Trainer]` of one actor), so an endpoint is an attribute of the
actor's class, checked where it is written, never a name looked up at run time. A rank is sent its own shard's
TrainBatch and only the shapes of the others (the loss normalises over the whole step), so the controller sends
each batch once, to the ranks that train on it.
"""

from dataclasses import dataclass
from typing import Generic, TypeVar

from forge_rl.deps.monarch import ActorMesh
from forge_rl.types import BatchShape, TrainBatch

A = TypeVar("A")


@dataclass(frozen=True)
class Ranks(Generic[A]):
    mesh: ActorMesh[A]  # every rank at once: `.call()` (checkpoints, exports), in the mesh's own rank order
    each: tuple[ActorMesh[A], ...]  # rank r alone, in flattened rank order
    shards: tuple[int, ...]  # the data-parallel shard (the index of the batch) rank r trains on

    @classmethod
    async def of(cls, mesh: ActorMesh[A]) -> "Ranks[A]":
        """The ranks of a mesh whose actors answer `data_shard` (Trainer, Critic, Reference)."""
        flat = mesh.flatten("rank")
        found = await flat.data_shard.call()
        shards = tuple(shard for _, shard in sorted(found.items(), key=lambda item: item[0]["rank"]))
        return cls(mesh, tuple(flat.slice(rank=r) for r in range(len(shards))), shards)

    def sending(self, batches: list[TrainBatch]) -> list[tuple[ActorMesh[A], list[TrainBatch | BatchShape]]]:
        """Each rank with what it is sent: its own shard's TrainBatch, the others' shapes only."""
        shapes = [b.shape_only() for b in batches]
        return [
            (rank, [b if i == shard else shapes[i] for i, b in enumerate(batches)])
            for rank, shard in zip(self.each, self.shards)
        ]

    def per_batch(self, results_of_ranks: list[list]) -> list:
        """From each rank's per-batch results (None for a batch it was sent the shape of), one result per batch,
        in batch order, from the first rank that holds it."""
        return [results_of_ranks[self.shards.index(i)][i] for i in range(max(self.shards) + 1)]
