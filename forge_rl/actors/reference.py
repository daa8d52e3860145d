"""Reference: the frozen policy that a KL penalty keeps the trained policy close to.

    reference = await Reference.options(procs=2, spmd=True).as_actor(trainer_cfg)
    batches = (await reference.fill_ref_logprobs.call(batches)).get(0)

It builds exactly the trainer's TorchTitan model (same checkpoint, parallelism, compute dtype and
temperature) on its own proc mesh and only ever runs forward passes, so the reference logprobs are of
the same distribution family as the trainer's. The optimizer it inherits never steps (AdamW allocates
no state before its first step).
"""

import dataclasses

import torch
from monarch.actor import endpoint

from forge_rl.actors.trainer import Trainer
from forge_rl.types import BatchShape, TrainBatch


class Reference(Trainer):
    @endpoint
    async def fill_ref_logprobs(self, batches: list[TrainBatch | BatchShape]) -> list[TrainBatch | BatchShape]:
        """`batches` with `ref_logprobs` set on each TrainBatch: the reference policy's logprob of every response
        token (0 elsewhere); BatchShapes (other ranks' batches, counts only) come back as they are. The run sends
        each rank its own batch, so every rank runs one forward (FSDP ranks gather parameters together: they
        must run as many). Given every batch, every rank runs every batch and any rank's result is whole."""
        self.model.eval()
        out = []
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, BatchShape):
                    out.append(batch)
                    continue
                logprobs, _ = self._forward(batch.tokens, response_mask=batch.response_mask)
                out.append(dataclasses.replace(batch, ref_logprobs=logprobs.cpu()))
        return out

    @endpoint
    async def train_step(self, batches: list[TrainBatch]) -> dict[str, float]:
        raise RuntimeError("the reference policy is frozen: train_step is the Trainer's")
