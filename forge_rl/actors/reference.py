"""Reference: the policy that a KL penalty keeps the trained policy close to (or a distillation teacher).

    reference = await Reference.options(procs=2, spmd=True).as_actor(trainer_cfg, weight_store_cfg)
    batches = (await reference.fill_ref_logprobs.call(batches)).get(0)
    await reference.follow.call(version)      # optional: become the policy's `version`, from the weight store

It builds exactly the trainer's TorchTitan model (`build_train_model`: same checkpoint, parallelism, compute dtype
and temperature) on its own proc mesh and only ever runs forward passes, so the reference logprobs are of the same
distribution family as the trainer's. It holds no optimizer.

Frozen by default. A reference that follows the policy (reference.follow_every, the run's) loads an earlier
version of the policy from the weight store every few steps: a KL to a moving anchor, self-distillation, reference
resets. Each rank reads only its shard of the version's file (forge_rl/models/sharded_load.py), so nothing is
gathered, and neither generation nor training waits for it: the run starts the load after a publish and only the
next reference scoring waits for it to finish. The weights are the version as published (the publish dtype).
"""

import dataclasses

import torch
from monarch.actor import endpoint

from forge_rl.actors.train_model import TrainModel
from forge_rl.actors.train_model_build import build_train_model
from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.models.sharded_load import load_sharded
from forge_rl.runtime import ForgeActor
from forge_rl.types import BatchShape, TrainBatch
from forge_rl.weights import ShmWeightStore, WeightStoreConfig


class Reference(ForgeActor):
    model: TrainModel

    def __init__(
        self, cfg: TrainerConfig | None = None, weight_store: WeightStoreConfig | None = None, weight_source=None
    ):
        self.cfg = cfg or TrainerConfig()
        self.store_cfg = weight_store
        self.store: ShmWeightStore | None = None  # opened at the first `follow`
        self.weight_source = weight_source  # the weight server, for ranks on another host than the trainer's rank 0
        self.policy_version = 0  # the policy version these weights are: 0, the model it was built from

    @endpoint
    async def setup(self) -> None:
        self.model = build_train_model(self.cfg)

    @endpoint
    async def fill_ref_logprobs(self, batches: list[TrainBatch | BatchShape]) -> list[TrainBatch | BatchShape]:
        """`batches` with `ref_logprobs` set on each TrainBatch: the reference policy's logprob of every response
        token (0 elsewhere); BatchShapes (other ranks' batches, counts only) come back as they are. The run sends
        each rank its own batch, so every rank runs one forward (FSDP ranks gather parameters together: they
        must run as many). Given every batch, every rank runs every batch and any rank's result is whole."""
        self.model.module.eval()
        out = []
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, BatchShape):
                    out.append(batch)
                    continue
                # over the kept sets the tokens were drawn from, as the trainer's: the KL is over the same set;
                # through the engine's experts too under Keep Routing (trainer.keep_routing, the trainer's config)
                logprobs, _ = self.model.logprobs(
                    batch.tokens,
                    response_mask=batch.response_mask,
                    kept=batch.kept,
                    routes=batch.routes,
                    images=batch.images,
                )
                out.append(dataclasses.replace(batch, ref_logprobs=logprobs.cpu()))
        reshard(self.model.module)
        return out

    @endpoint
    async def follow(self, version: int, timeout_s: float = 600.0) -> int:
        """Load the policy's `version` from the weight store in place of these weights (every rank its shard).
        Returns the version these weights now are."""
        if self.store is None:
            self.store = ShmWeightStore(cfg=self.store_cfg, source=self.weight_source)
        await self.store.prefetch(version, timeout=timeout_s)  # another host's: copied here first
        with self.store.pinned(version) as path:
            # trainer.freeze's parameters are not in a pushed version: they stay the checkpoint's, as the policy's
            load_sharded(self.model.module, self.model.adapter, path, kept=tuple(self.model.cfg.freeze))
        self.policy_version = version
        return version

    @endpoint
    async def version(self) -> int:
        """The policy version the reference's weights are (0: the model it was built from)."""
        return self.policy_version

    @endpoint
    async def data_shard(self) -> int:
        """This rank's data-parallel shard: the index of the batch it scores."""
        return self.model.dp_rank

    @endpoint
    async def load_stats(self) -> dict[str, int]:
        """What this rank read of the checkpoint at start: bytes_read, largest_read, checkpoint_bytes."""
        return dict(self.model.checkpoint_read)

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.store is not None:
            self.store.close()


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP unit's gathered parameters. TorchTitan's last unit (final norm and LM head) is not resharded
    after its forward, as the backward that would reshard it needs it: a reference never runs one, so without this it
    would hold the whole LM head (1.2 GB at Qwen3-8B) from its first scoring on, and `follow` would load into that
    gathered copy instead of the shards (a rehearsal of the reference shows both)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
