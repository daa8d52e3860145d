"""Checkpoints of a whole run: the trainer's DCP checkpoint plus the controller's state beside it.

    path = await save_checkpoint(run, trainer, buffer, dataset, step)    # <checkpoint_dir>/step-N/
    step, path = await resume_from_checkpoint(run, trainer, generator, buffer, dataset, checkpoint_dir)

The controller's state (`app_state.pt` in the trainer's step directory) holds the policy version, the drop
counters, the replay buffer's groups and the dataset's position, so a resumed run continues with the same
step, optimizer, buffer contents and data. A step directory without `app_state.pt` is not a run checkpoint
(the run died while writing it) and is never resumed from.
"""

from pathlib import Path

import torch

from forge_rl.rollout import Admission
from forge_rl.train_loop import Run

APP_STATE = "app_state.pt"


async def save_checkpoint(run: Run, trainer, buffer, dataset, step: int) -> Path:
    """Trainer DCP checkpoint plus the controller's state (buffer, data position, counters)."""
    path = Path((await trainer.save.call(step)).item(procs=0))
    state = dict(version=run.version, drops=run.drops, buffer=await buffer.state_dict.call_one(),
                 dataset=await dataset.state_dict.call_one())
    torch.save(state, path / APP_STATE)
    return path


def latest_checkpoint(checkpoint_dir: Path) -> Path:
    """The newest complete run checkpoint under `checkpoint_dir`."""
    candidates = sorted((p for p in checkpoint_dir.glob("step-*") if (p / APP_STATE).is_file()),
                        key=lambda p: int(p.name.split("-")[1]))
    if not candidates:
        raise FileNotFoundError(f"resume=true but no checkpoint with {APP_STATE} under {checkpoint_dir}")
    return candidates[-1]


async def resume_from_checkpoint(run: Run, trainer, generator, buffer, dataset, checkpoint_dir: Path) -> tuple[int, Path]:
    """Load the newest checkpoint into the trainer, buffer, dataset and `run`, and give the generators its
    weights. Returns the step it was taken at and its path."""
    path = latest_checkpoint(checkpoint_dir)
    step = (await trainer.load.call(str(path))).item(procs=0)
    state = torch.load(path / APP_STATE, weights_only=False)
    run.version = state["version"]
    run.drops.update(state["drops"])
    run.admission = Admission(run.cfg.max_policy_age, run.cfg.batch_groups, run.version)
    await buffer.load_state_dict.call_one(state["buffer"])
    await dataset.load_state_dict.call_one(state["dataset"])
    run.admission.buffered = (await buffer.stats.call_one())["groups"]
    if run.version > 0:  # the generators start from the model dir: give them the resumed weights
        await trainer.push_weights.call(run.version)
        await generator.update_weights.call_all(run.version)
    return step, path
