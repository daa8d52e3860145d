"""Checkpoints of a whole run: the trainer's DCP checkpoint plus the controller's state beside it.

    path = await save_checkpoint(run, trainer, buffer, dataset, step, checkpoint_dir, keep_last=3)
    step, path = await resume_from_checkpoint(run, trainer, generator, buffer, dataset, checkpoint_dir)

The controller's state (`app_state.pt` in the trainer's step directory) holds the policy version, the drop
counters, the replay buffer's groups and the dataset's position, so a resumed run continues with the same
step, optimizer, buffer contents and data. A step directory without `app_state.pt` is not a run checkpoint
(written before saves were atomic) and is never resumed from.
"""

import shutil
from pathlib import Path

import torch

from forge_rl.loop.rollout import Admission
from forge_rl.loop.train_loop import Run

APP_STATE = "app_state.pt"


async def save_checkpoint(run: Run, trainer, buffer, dataset, step: int, checkpoint_dir: Path,
                          keep_last: int = 0, others: dict | None = None) -> Path:
    """Trainer DCP checkpoint plus the controller's state (buffer, data position, counters), as
    `checkpoint_dir/step-N`; each of `others` (name -> another trained actor: PPO's critic) saves its own DCP
    checkpoint into step-N/<name>. Written under a temporary name and renamed when complete: a failure midway
    (a full disk, a kill) leaves every earlier checkpoint as it was. Then only the newest `keep_last`
    complete checkpoints are kept (0: all)."""
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / f"step-{step}"
    partial = checkpoint_dir / f".step-{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # what an earlier failed save left
    try:
        await trainer.save.call(step, str(partial))
        for name, actor in (others or {}).items():
            await actor.save.call(step, str(partial / name))
        state = dict(version=run.version, drops=run.drops, buffer=await buffer.state_dict.call_one(),
                     dataset=await dataset.state_dict.call_one())
        torch.save(state, partial / APP_STATE)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if final.exists():  # the same step saved again (a resumed run's last step): replace it whole
        replaced = checkpoint_dir / f".step-{step}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
        partial.rename(final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        partial.rename(final)
    if keep_last > 0:
        for old in complete_checkpoints(checkpoint_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """The complete run checkpoints under `checkpoint_dir`, oldest first."""
    return sorted((p for p in Path(checkpoint_dir).glob("step-*") if (p / APP_STATE).is_file()),
                  key=lambda p: int(p.name.split("-")[1]))


def resume_requested(resume: bool | str, checkpoint_dir: Path) -> bool:
    """`resume`: true continues from the newest complete checkpoint (an error if there is none); "auto" does
    when there is one and starts afresh otherwise (a requeued Slurm job, a rerun after a crash)."""
    if resume not in (True, False, "auto"):
        raise ValueError(f"resume={resume!r}: use true, false or auto")
    return resume is True or (resume == "auto" and bool(complete_checkpoints(checkpoint_dir)))


def latest_checkpoint(checkpoint_dir: Path) -> Path:
    """The newest complete run checkpoint under `checkpoint_dir`."""
    candidates = complete_checkpoints(checkpoint_dir)
    if not candidates:
        raise FileNotFoundError(f"resume=true but no checkpoint with {APP_STATE} under {checkpoint_dir}")
    return candidates[-1]


async def resume_from_checkpoint(run: Run, trainer, generator, buffer, dataset, checkpoint_dir: Path,
                                others: dict | None = None) -> tuple[int, Path]:
    """Load the newest checkpoint into the trainer, `others` (as saved by save_checkpoint), buffer, dataset and
    `run`, and give the generators its weights. Returns the step it was taken at and its path."""
    path = latest_checkpoint(checkpoint_dir)
    step = (await trainer.load.call(str(path))).get(0)
    for name, actor in (others or {}).items():
        if not (path / name).is_dir():
            raise FileNotFoundError(f"{path} has no {name}/ checkpoint: it was written by a run without a {name}")
        await actor.load.call(str(path / name))
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
