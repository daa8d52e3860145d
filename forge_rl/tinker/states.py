"""Training state (save_state, and a training client created from it): forge_rl's trainer checkpoints. A state is a
committed checkpoint of the client's trainer (DCP shards written by every rank, hashed where written, a manifest,
then one rename: a state is whole or absent), named tinker://<model>/weights/<name>. Loading verifies it first, and
restores the weights, the optimizer's state and the step (or the weights alone), so training resumes exactly.
States live as long as the service (they are looked up by path in its memory; the files stay in output_dir)."""

import itertools
import time
from datetime import UTC, datetime
from pathlib import Path

from forge_rl.runtime.manifest import verify
from forge_rl.tinker.errors import Refused
from forge_rl.tinker.training import Training


class States:
    def __init__(self, training: Training):
        self.training = training
        self.saved: dict[str, tuple[str, str]] = {}  # tinker path -> (owner, checkpoint directory)
        self.saved_at: dict[str, float] = {}  # tinker path (states and named sampler weights) -> when, epoch s
        self._labels = itertools.count(1)

    async def save(self, owner: str, model_id: str, name: str | None, overwrite: bool) -> dict:
        model = self.training.model(owner, model_id)
        name = name or f"state-{model.steps:06d}"
        path = f"tinker://{model_id}/weights/{name}"
        if path in self.saved and not overwrite:
            raise Refused(f"a state named {name!r} exists for {model_id}: choose another name or pass overwrite=True")
        async with model.lock:
            await model.use()
            results = await model.trainer.save.call(next(self._labels))
            written = next(iter(results.values()))
        self.saved[path] = (owner, written)
        self.saved_at[path] = time.time()
        return {"path": path, "type": "save_weights"}

    def _checkpoint(self, owner: str, path: str) -> str:
        found = self.saved.get(path)
        if found is None or found[0] != owner:
            raise Refused(f"no saved state at {path!r} for this key: save_state(name) gives the path to load")
        problem = verify(Path(found[1]))
        if problem is not None:
            raise Refused(f"the state at {path} is damaged ({problem}); load an earlier one")
        return found[1]

    async def load(self, owner: str, model_id: str, path: str, optimizer: bool, new: str | None) -> dict:
        """Into the training client `model_id`; with `new` (create_training_client_from_state), into a new one of
        that id."""
        checkpoint = self._checkpoint(owner, path)
        if new is not None:
            await self.training.create(owner, new, self.training.cfg.model, None, None)
        model = self.training.model(owner, model_id)
        async with model.lock:
            await model.use()
            steps = await model.trainer.load.call(checkpoint)
            if not optimizer:
                await model.trainer.forget_optimizer_state.call()
            model.steps = int(next(iter(steps.values())))
        return {"path": path, "model_id": model_id, "type": "load_weights"}

    def listing(self, owner: str, model_id: str, sampler_paths: dict) -> dict:
        """The REST listing of a training client's checkpoints: its states and its named sampler weights."""
        self.training.model(owner, model_id)  # another key's model is unknown
        rows = []
        for path, (holder, directory) in self.saved.items():
            if holder == owner and path.startswith(f"tinker://{model_id}/"):
                size = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
                rows.append(_row(path, "training", self.saved_at[path], size))
        for path, sampler in sampler_paths.items():
            if sampler.owner == owner and path.startswith(f"tinker://{model_id}/"):
                rows.append(_row(path, "sampler", self.saved_at.setdefault(path, time.time()), None))
        return {"checkpoints": rows, "cursor": None}


def _row(path: str, kind: str, when: float, size: int | None) -> dict:
    stamp = datetime.fromtimestamp(when, UTC).isoformat()
    return {
        "checkpoint_id": path.split("/", 3)[3],
        "checkpoint_type": kind,
        "time": stamp,
        "tinker_path": path,
        "size_bytes": size,
    }
