"""The train loop's parts that every group-based RL app shares: the run's shared state, waiting for a batch
(and saying why none comes), the staleness of a batch, and moving the generators to a new version.

    run = RunState(cfg)                 # cfg: max_policy_age, batch_groups, no_batch_timeout_s
    batches, waited_s = await wait_for_batch(run, buffer, rollout_tasks)
    staleness, oldest = batch_staleness(batches, run.version)
    ... Trainer.step(batches, run.version + 1) on every rank (forge_rl/recipes/rl_step.py) ...
    run.version += 1
    updates = await update_generators(run, generator, run.version)
"""

import asyncio
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from forge_rl.actors.reward import RewardRoleDied
from forge_rl.deps.monarch import SupervisionError
from forge_rl.errors import RunStopped
from forge_rl.loop.rollout import Admission, RewardFailing, RolloutStats
from forge_rl.runtime.faults import RoleStartFailed, lost_role, why_lost
from forge_rl.runtime.manifest import complete_checkpoints, intact
from forge_rl.runtime.timeouts import within
from forge_rl.types import TrainBatch


SAMPLE_WAIT_S = 0.1


class NoBatchError(RunStopped):
    """The train loop waited `no_batch_timeout_s` without a batch; the message says why."""


class RoleDied(RunStopped):
    """A role's process died under the run (killed, out of memory, a crash in native code). The message
    names the role and the checkpoint a rerun can continue from."""


def role_died(
    error: BaseException,
    checkpoint_dir: str | Path,
    log_dir: str | Path | None = None,
    run_id: str | None = None,
    roles: Iterable[str] = (),
) -> RoleDied:
    """A RoleDied for Monarch's SupervisionError `error`: which actor died, where its last words are (the
    procs' logs under `log_dir`, when the run keeps them) and where to resume (run `run_id`'s checkpoints).
    `roles`: the run's role names, to name one that Monarch gives only in lower case."""
    logs = f"; its output is in {log_dir}/" if log_dir else ""
    if isinstance(error, RoleStartFailed):  # lost while it started: the error names it
        return RoleDied(f"{error}{logs}; {resume_hint(checkpoint_dir, run_id)}")
    name = lost_role(error, roles)
    role = f"the {name} process" if name else "a role's process"
    return RoleDied(f"{role} died ({why_lost(error)}){logs}; {resume_hint(checkpoint_dir, run_id)}")


def resume_hint(checkpoint_dir: str | Path, run_id: str | None) -> str:
    """Where a rerun of a stopped run continues from: the newest checkpoint of run `run_id` that is intact as
    far as this process knows (hashed when written or at resume; otherwise its files' sizes). Another run's are
    never named. No file is read here: this runs as a run stops."""
    mine = complete_checkpoints(Path(checkpoint_dir), run_id) if run_id else []
    newest = next((p for p in reversed(mine) if intact(p, read=False)), None)
    if newest is not None:
        return (
            f"the last complete checkpoint is {newest}: continue from it with resume=true (or resume=auto), "
            "which checks its files first"
        )
    return (
        f"no complete checkpoint of this run under {checkpoint_dir} yet (checkpoint_every saves every N steps): a "
        "rerun with resume=auto (or overwrite=true) starts it again from the beginning"
    )


class RunState:
    """The state one run shares between its rollout tasks and its train loop. `cfg` is the app's config;
    this reads its max_policy_age, batch_groups and no_batch_timeout_s."""

    def __init__(self, cfg: Any, version: int = 0):
        self.cfg = cfg
        self.version = version  # policy version = trainer steps taken
        self.rollouts = RolloutStats()
        self.admission = Admission(cfg.max_policy_age, cfg.batch_groups, version, getattr(cfg, "steps", None))
        self.trainer_busy_s = 0.0  # the trainer's steps (train and publish), as the controller waits for them
        self.staleness_sum, self.staleness_steps = 0.0, 0
        self.max_staleness = 0  # over every batch trained on: must stay <= max_policy_age
        self.mismatch: list[tuple[float, float]] = []  # per step: mean and max |log pi - log mu| (train/inference)
        self.last_updates: list[dict] | None = None  # the newest finished generator weight update
        self.engines_read: tuple[float, float] | None = None  # (when, the replicas' mean busy_s): see engines_busy
        self.stop = asyncio.Event()

    @property
    def drops(self) -> dict[str, int]:
        return self.rollouts.drops


def batch_staleness(batches: list[TrainBatch], version: int) -> tuple[float, int]:
    """Mean and max of (trainer version - version that generated the token) over response tokens."""
    ages = torch.cat([version - b.policy_versions[b.response_mask] for b in batches])
    return float(ages.float().mean()), int(ages.max())


async def wait_for_batch(
    run: RunState, buffer, rollouts: list[asyncio.Task], before: dict | None = None
) -> tuple[list[TrainBatch], float]:
    """Sample a batch at the run's version, waiting while rollouts fill the buffer. Raises at once when a
    rollout task died, and NoBatchError (saying why) after no_batch_timeout_s without a batch. `before`: the
    buffer's stats as the wait starts, when the caller has them (one round trip fewer per step)."""
    start = time.perf_counter()
    before = before if before is not None else await buffer.stats.call_one()
    drops_before = dict(run.drops)
    # The buffer waits for the batch itself (each add wakes it); a call returns empty every SAMPLE_WAIT_S so
    # that failed rollouts, stale drops (which admission must hear of) and the timeout are noticed.
    sample = buffer.sample.call_one
    while (batches := await sample(run.version, run.cfg.batch_groups, wait_s=SAMPLE_WAIT_S)) is None:
        raise_if_failed(rollouts)
        stored = run.admission.stored
        await run.admission.buffer_holds((await buffer.stats.call_one())["groups"], stored)
        if time.perf_counter() - start > run.cfg.no_batch_timeout_s:
            raise NoBatchError(why_no_batch(run, before, await buffer.stats.call_one(), drops_before))
    return batches, time.perf_counter() - start


def raise_if_failed(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            if isinstance(t.exception(), (SupervisionError, RewardRoleDied, RewardFailing)):  # the run's, named
                raise t.exception()
            raise RuntimeError(f"a rollout task failed: {t.exception()}") from t.exception()


# What each drop reason of a rollout means, for the no-batch diagnosis (the dominant one is named).
WHY_DROPPED = {
    "reward_error": "a reward function raises or returns something that is not one float per completion",
    "reward_timeout": "a reward takes longer than reward_timeout_s (raise it, or make the reward faster)",
    "reward_crash": "a reward's worker process dies (a segfault in native code, the OOM killer)",
    "reward_memory": "a reward allocates past reward_memory_mb",
    "reward_unparsable": "the judge's verdicts hold no number its parser reads (rewards[i].parser)",
    "prompt_too_long": "prompts do not fit the engine's max_model_len with max_tokens",
    "env_error": "the environment raises (reset, step or rendering its messages)",
    "generation_error": "the generator fails on a turn",
}


def why_no_batch(run: RunState, before: dict, now: dict, drops_before: dict) -> str:
    cfg, adm = run.cfg, run.admission
    dropped = {r: now["dropped"][r] - before["dropped"][r] for r in now["dropped"]}
    dropped.update({r: v - drops_before.get(r, 0) for r, v in run.drops.items()})
    added = now["added"] - before["added"]
    lines = [
        f"no batch of {cfg.batch_groups} groups for {cfg.no_batch_timeout_s:.0f} s (no_batch_timeout_s) at "
        f"policy version {run.version}; meanwhile {added} episodes reached the buffer, {now['groups']} groups "
        f"are in it, {adm.in_flight} rollouts in flight; drops: {dropped}"
    ]
    failing = {r: n for r, n in dropped.items() if n > 0 and r in WHY_DROPPED}
    if added and dropped.get("zero_advantage", 0) == added:
        lines.append(
            "every group had zero advantage: all its completions got the same reward (a broken reward, "
            "a task too easy or too hard, a chat template that makes the model emit something else)"
        )
    elif added and dropped.get("stale", 0) >= added:
        lines.append("every group arrived too old for max_policy_age")
    elif failing:
        reason = max(failing, key=failing.get)
        lines.append(f"most groups were dropped for {reason} ({failing[reason]} episodes): {WHY_DROPPED[reason]}")
    elif not added:
        lines.append("no rollout finished: the generator is stuck or far too slow for this timeout")
    return "; ".join(lines)


async def update_generators(
    run: RunState, generator, version: int, timeout_s: float | None = None, where: str = ""
) -> list[dict]:
    """Every replica loads `version`; StepTimeout after `timeout_s` (timeouts.weight_load_s)."""
    updates = await within(
        generator.update_weights.call_all(version),
        timeout_s,
        "weight_load_s",
        f"the Generators' update_weights to version {version}",
        where,
    )
    await run.admission.generators_at(version)
    return updates
