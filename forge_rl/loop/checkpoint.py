"""Checkpoints of a whole run: the trainer's DCP checkpoint plus the controller's state beside it, with a
manifest of checksums, owned by the run that wrote it.

    path = await save_checkpoint(run, trainer, buffer, dataset, step, checkpoint_dir, keep_last=3, run_id=rid)
    path, skipped = newest_intact(checkpoint_dir, rid)     # the checkpoint to resume from, and what was passed over
    step = await resume_from_checkpoint(run, trainer, generator, buffer, dataset, path)

The controller's state (`app_state.pt` in the trainer's step directory) holds the policy version, the drop
counters, the replay buffer's groups and the dataset's position, so a resumed run continues with the same
step, optimizer, buffer contents and data. `manifest.json` (forge_rl/runtime/manifest.py) is written last and
names the run: a step directory without one is not a complete checkpoint, and resume takes the newest of the
run's checkpoints whose files all match their checksums. Retention counts only those: the newest `keep_last`
intact checkpoints of the run are kept, the one just written always among them, and a damaged one never
displaces an intact one; another run's checkpoints, and those whose owner cannot be told, are never removed.
The files are hashed by whoever wrote them (each trainer rank its own shards); what is left to the controller
(the manifest, its own app_state.pt, the renames, the removals) runs in threads, off its event loop.
"""

import asyncio
import errno
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from forge_rl.errors import RunStopped, disk_refused, free_bytes
from forge_rl.loop.rollout import Admission
from forge_rl.loop.train_loop import RunState
from forge_rl.runtime.manifest import commit, complete_checkpoints, intact, newest_intact, step_dirs, step_of

__all__ = [
    "APP_STATE",
    "commit_checkpoint",
    "complete_checkpoints",
    "newest_intact",
    "prune",
    "resume_from_checkpoint",
    "save_checkpoint",
    "step_dirs",
    "step_of",
]

APP_STATE = "app_state.pt"


async def commit_checkpoint(
    checkpoint_dir: Path, step: int, run_id: str, write: Callable[[Path], Awaitable], keep_last: int = 0
) -> Path:
    """`checkpoint_dir/step-N`, written whole or not at all: `write(tmp)` fills a temporary directory, the
    manifest of checksums goes in last, and a rename makes it complete. A failure midway (a full disk, a kill)
    leaves every earlier checkpoint as it was; a full disk or a read-only folder raises RunStopped, one line naming
    where, the room a checkpoint needs (the larger of what was written and the last complete checkpoint) and the
    checkpoint to continue from. Then retention (`prune`) keeps the newest `keep_last` intact
    checkpoints of run `run_id` (0: all)."""
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / f"step-{step}"
    partial = checkpoint_dir / f".step-{step}.{run_id}.partial"  # the run's own: another run's are not touched
    await _to_the_end(shutil.rmtree, partial, True)  # what an earlier failed save of this run left
    try:
        await write(partial)
        await _to_the_end(commit, partial, final, run_id, step)
    except BaseException as e:
        written = _size(partial)
        shutil.rmtree(partial, ignore_errors=True)
        full = disk_refused(e)
        if (
            full is None
            and isinstance(e, Exception)
            and free_bytes(checkpoint_dir) < _needed(checkpoint_dir, run_id, written)
        ):
            # a writer that hides the OSError (torch.save's zip writer: "unexpected pos") on a disk too full
            full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(checkpoint_dir))
        if full is not None:
            raise RunStopped(no_room(full, final, written, checkpoint_dir, run_id)) from None
        raise
    if keep_last > 0:
        await _to_the_end(prune, checkpoint_dir, run_id, keep_last, final)
    return final


def no_room(error: OSError, final: Path, written: int, checkpoint_dir: Path, run_id: str) -> str:
    """One line: which checkpoint could not be written where, the room it needs next to the room there is, and the
    checkpoint to resume from (the newest intact one of the run, untouched)."""
    previous = complete_checkpoints(checkpoint_dir, run_id)
    needed = _needed(checkpoint_dir, run_id, written)
    where = error.filename or checkpoint_dir
    if error.errno == errno.EROFS:
        why = f"{where} is on a read-only file system"
    else:
        free = free_bytes(checkpoint_dir)
        need = f", a checkpoint needs about {needed / 2**20:.1f} MiB" if needed > free else ""
        why = f"no space left at {where}: {free / 2**20:.1f} MiB free{need}"
    resume = next((p for p in reversed(previous) if intact(p, read=False)), None)
    then = f"continue from {resume} with resume=true" if resume else "no earlier checkpoint of this run exists"
    return f"checkpoint {final.name} not written ({why}); make room in {checkpoint_dir}, then {then}"


def _needed(checkpoint_dir: Path, run_id: str, written: int) -> int:
    """The room a checkpoint takes: the larger of what this one wrote and the run's last complete one."""
    return max([written, *(_size(p) for p in complete_checkpoints(checkpoint_dir, run_id)[-1:])])


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).is_dir() else 0


def prune(checkpoint_dir: Path, run_id: str, keep_last: int, newest: Path) -> list[Path]:
    """Remove run `run_id`'s checkpoints older than `newest` (just written, never removed) but for the newest
    intact ones, `keep_last` in all with it; returns what was removed. A damaged checkpoint is never counted:
    an older one is removed (resume could not use it), a newer one is left (resume passes over it, naming it;
    saving its step again replaces it)."""
    kept, doomed = 0, []
    for path in reversed(complete_checkpoints(checkpoint_dir, run_id)):
        if path == newest:
            kept += 1
        elif step_of(path) > step_of(newest):
            continue
        elif kept < keep_last and intact(path):
            kept += 1
        else:
            doomed.append(path)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


async def _to_the_end(fn, *args):
    """`fn(*args)` in a thread, off the event loop, awaited to its end even when the caller is cancelled (a
    half-made rename must not race the clean-up after it)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise


async def save_checkpoint(
    run: RunState,
    trainer,
    buffer,
    dataset,
    step: int,
    checkpoint_dir: Path,
    keep_last: int = 0,
    others: dict | None = None,
    run_id: str = "",
) -> Path:
    """Trainer DCP checkpoint plus the controller's state (buffer, data position, counters), as
    `checkpoint_dir/step-N` (commit_checkpoint); each of `others` (name -> another trained actor: PPO's critic)
    saves its own DCP checkpoint into step-N/<name>."""

    async def write(partial: Path) -> None:
        await trainer.save.call(step, str(partial))
        for name, actor in (others or {}).items():
            await actor.save.call(step, str(partial / name))
        state = dict(
            version=run.version,
            drops=run.drops,
            buffer=await buffer.state_dict.call_one(),
            dataset=await dataset.state_dict.call_one(),
        )
        await _to_the_end(torch.save, state, partial / APP_STATE)

    return await commit_checkpoint(checkpoint_dir, step, run_id, write, keep_last)


async def resume_from_checkpoint(
    run: RunState, trainer, generator, buffer, dataset, path: Path, others: dict | None = None
) -> int:
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
    run.admission = Admission(
        run.cfg.max_policy_age, run.cfg.batch_groups, run.version, getattr(run.cfg, "steps", None)
    )
    await buffer.load_state_dict.call_one(state["buffer"])
    await dataset.load_state_dict.call_one(state["dataset"])
    run.admission.buffered = (await buffer.stats.call_one())["groups"]
    if run.version > 0:  # the generators start from the model dir: give them the resumed weights
        await trainer.push_weights.call(run.version)
        await generator.update_weights.call_all(run.version)
    return step
