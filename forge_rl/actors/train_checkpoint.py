"""DCP checkpoints of a trained model: its tensors, the optimizer, the schedule, the step count and the torch RNG.

    checkpoint = TrainCheckpoint(model, optimizer, scheduler, counts)
    await checkpoint.save(step, path)     # every rank its own shards, hashed for the run's manifest
    step = checkpoint.load(path)

The Trainer and the Critic each hold one. The model's state is its parameters themselves (each rank's shards; DCP
loads into them in place) and persistent buffers, by their own names; with LoRA the adapters alone (the frozen base
comes from trainer.model on every start). Not `model.state_dict()`: TorchTitan's hook gathers every fused q/k/v whole.
"""

import asyncio
import shutil
from pathlib import Path

import torch

from forge_rl.actors.train_model import TrainModel
from forge_rl.actors.train_optimizer import StepCounts
from forge_rl.models.lora import is_adapter_key
from forge_rl.runtime.manifest import STANDALONE, commit, newest_intact, write_rank_digests


class TrainCheckpoint:
    def __init__(self, model: TrainModel, optimizer, scheduler, counts: StepCounts):
        self.model, self.optimizer, self.scheduler, self.counts = model, optimizer, scheduler, counts

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {
            "model": self._model_tensors(),
            "optim": get_optimizer_state_dict(self.model.module, self.optimizer),
            # the torch RNG: LoRA's dropout draws from it, so a resumed run drops what the uninterrupted one did
            "train": {
                "step": self.counts.taken,
                "scheduler": self.scheduler.state_dict(),
                "rng": torch.get_rng_state(),
            },
        }

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        module = self.model.module
        tensors = {name: p.detach() for name, p in module.named_parameters()}
        tensors.update(_persistent_buffers(module))
        if self.model.cfg.lora.enabled:
            tensors = {k: v for k, v in tensors.items() if is_adapter_key(k)}
        return tensors

    async def save(self, step: int | None = None, path: str | None = None) -> str:
        """Into `path`, each rank writing its own shards and hashing them in a thread (`.sha256-rank-N.json`, for the
        manifest the caller commits: forge_rl/loop/checkpoint.py). Without `path`: checkpoint_dir/step-N, committed
        here whole with its manifest (owner "trainer"), as a run's checkpoints are."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        step = self.counts.taken if step is None else step
        rank = self.model.rank
        final = Path(self.model.cfg.checkpoint_dir) / f"step-{step}"
        target = Path(path) if path else final.parent / f".step-{step}.{STANDALONE}.partial"
        if path is None and rank == 0:
            shutil.rmtree(target, ignore_errors=True)  # an earlier failed save's
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=str(target))
        await asyncio.to_thread(write_rank_digests, target, rank)
        dist.barrier()
        if path is None:
            if rank == 0:
                await asyncio.to_thread(commit, target, final, STANDALONE, step)
            dist.barrier()
        return str(path or final)

    def load(self, path: str | None = None) -> int:
        """Restore from `path` (a run's checkpoint: the run verified it), or without one from the newest intact
        checkpoint that `save()` without a path wrote under checkpoint_dir (rank 0 verifies). Returns the step."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        path = path or self._newest()
        if not (Path(path) / ".metadata").is_file():
            raise FileNotFoundError(f"{path}: not a DCP checkpoint (no .metadata)")
        state = self._state()
        if "train.rng" not in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
            del state["train"]["rng"]  # a checkpoint without the trainer's RNG state (an older format)
        dcp.load(state, checkpoint_id=path)  # into the parameters' own shards, in place
        set_optimizer_state_dict(self.model.module, self.optimizer, state["optim"])
        self.scheduler.load_state_dict(state["train"]["scheduler"])
        if "rng" in state["train"]:
            torch.set_rng_state(state["train"]["rng"])
        self.counts.taken = int(state["train"]["step"])
        return self.counts.taken

    def _newest(self) -> str:
        import torch.distributed as dist

        checkpoint_dir = self.model.cfg.checkpoint_dir
        found = [newest_intact(checkpoint_dir, STANDALONE) if self.model.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        newest, skipped = found[0]
        if newest is None:
            why = f" (passed over {'; '.join(skipped)})" if skipped else ""
            raise FileNotFoundError(
                f"no intact checkpoint of Trainer.save() under trainer.checkpoint_dir={checkpoint_dir}{why}: "
                "pass the path of one to load"
            )
        return str(newest)


def _persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict would hold (TorchTitan's RoPE caches are not among them: every start rebuilds them)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf.detach()
    return out
