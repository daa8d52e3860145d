"""Checkpoints of a whole run: the trainer's DCP checkpoint plus the controller's state beside it, with a
manifest of checksums, owned by the run that wrote it.

    path = await save_checkpoint(run, trainer, buffer, dataset, step, checkpoint_dir, keep_last=3, run_id=rid)
    path, skipped = newest_intact(checkpoint_dir, rid)     # the checkpoint to resume from, and what was passed over
    step = await resume_from_checkpoint(run, trainer, generator, buffer, dataset, path)

The controller's state (`app_state.pt` in the trainer's step directory) holds the policy version, the drop
counters, the replay buffer's groups and the dataset's position, so a resumed run continues with the same
step, optimizer, buffer contents and data. `manifest.json` (forge_rl/loop/manifest.py) is written last and
names the run: a step directory without one is not a complete checkpoint, retention prunes only the run's own,
and resume takes the newest of the run's checkpoints whose files all match their checksums.
"""

import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from forge_rl.loop.manifest import owner, verify, write_manifest
from forge_rl.loop.rollout import Admission
from forge_rl.loop.train_loop import Run

APP_STATE = "app_state.pt"


async def commit_checkpoint(checkpoint_dir: Path, step: int, run_id: str, write: Callable[[Path], Awaitable],
                            keep_last: int = 0) -> Path:
    """`checkpoint_dir/step-N`, written whole or not at all: `write(tmp)` fills a temporary directory, the
    manifest of checksums goes in last, and a rename makes it complete. A failure midway (a full disk, a kill)
    leaves every earlier checkpoint as it was. Then only the newest `keep_last` complete checkpoints of run
    `run_id` are kept (0: all); another run's are never touched."""
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / f"step-{step}"
    partial = checkpoint_dir / f".step-{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # what an earlier failed save left
    try:
        await write(partial)
        write_manifest(partial, run_id, step)
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
        for old in complete_checkpoints(checkpoint_dir, run_id)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


async def save_checkpoint(run: Run, trainer, buffer, dataset, step: int, checkpoint_dir: Path,
                          keep_last: int = 0, others: dict | None = None, run_id: str = "") -> Path:
    """Trainer DCP checkpoint plus the controller's state (buffer, data position, counters), as
    `checkpoint_dir/step-N` (commit_checkpoint); each of `others` (name -> another trained actor: PPO's critic)
    saves its own DCP checkpoint into step-N/<name>."""
    async def write(partial: Path) -> None:
        await trainer.save.call(step, str(partial))
        for name, actor in (others or {}).items():
            await actor.save.call(step, str(partial / name))
        state = dict(version=run.version, drops=run.drops, buffer=await buffer.state_dict.call_one(),
                     dataset=await dataset.state_dict.call_one())
        torch.save(state, partial / APP_STATE)

    return await commit_checkpoint(checkpoint_dir, step, run_id, write, keep_last)


def step_of(path: Path) -> int:
    return int(Path(path).name.split("-")[1])


def step_dirs(checkpoint_dir: Path) -> list[Path]:
    """Every step-N directory under `checkpoint_dir`, whoever wrote it and whatever its state, oldest first."""
    return sorted((p for p in Path(checkpoint_dir).glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                  key=step_of)


def complete_checkpoints(checkpoint_dir: Path, run_id: str | None = None) -> list[Path]:
    """The complete checkpoints under `checkpoint_dir` (a manifest written), of run `run_id` only when given,
    oldest first. Completeness is not integrity: `verify` reads the files."""
    return [p for p in step_dirs(checkpoint_dir) if (o := owner(p)) is not None and run_id in (None, o)]


def newest_intact(checkpoint_dir: Path, run_id: str) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of run `run_id` whose files match their manifest, and why each newer candidate was
    passed over ('step-12: checksum mismatch in __0_0.distcp'). Candidates are the run's step directories and
    those without a readable manifest (whose owner cannot be told; a damaged one of this run's among them)."""
    skipped = []
    for path in reversed(step_dirs(checkpoint_dir)):
        if owner(path) not in (run_id, None):
            continue  # another run's
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name}: {problem}")
    return None, skipped


async def resume_from_checkpoint(run: Run, trainer, generator, buffer, dataset, path: Path,
                                 others: dict | None = None) -> int:
    """Load the checkpoint at `path` (verified: newest_intact) into the trainer, `others` (as saved by
    save_checkpoint), buffer, dataset and `run`, and give the generators its weights. Returns its step."""
    path = Path(path)
    step = (await trainer.load.call(str(path))).get(0)
    for name, actor in (others or {}).items():
        if not (path / name).is_dir():
            raise FileNotFoundError(f"{path} has no {name}/ checkpoint: it was written by a run without a {name}")
        await actor.load.call(str(path / name))
    state = torch.load(path / APP_STATE, weights_only=False)
    run.version = state["version"]
    run.drops.update(state["drops"])
    run.admission = Admission(run.cfg.max_policy_age, run.cfg.batch_groups, run.version,
                              getattr(run.cfg, "steps", None))
    await buffer.load_state_dict.call_one(state["buffer"])
    await dataset.load_state_dict.call_one(state["dataset"])
    run.admission.buffered = (await buffer.stats.call_one())["groups"]
    if run.version > 0:  # the generators start from the model dir: give them the resumed weights
        await trainer.push_weights.call(run.version)
        await generator.update_weights.call_all(run.version)
    return step
