"""A run checkpoint is written whole or not at all: a save that fails midway (a full disk) leaves the earlier
checkpoints as they were; keep_last counts only intact checkpoints and never removes the one just written; the
hint a stopped run prints names only its own newest intact checkpoint; finish() lets the rollouts in flight land
before its checkpoint, and sums up a run never evaluated. The trainer here is a fault injector that writes files
as DCP would and can fail partway; the real trainer's save runs in tests/integration/test_grpo_app.py."""

import asyncio
import errno
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from forge_rl.errors import RunStopped
from forge_rl.recipes.rl_run import RLRun
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.grpo_report import run_summary, summary_block
from forge_rl.recipes.roles import Roles
from forge_rl.loop.checkpoint import APP_STATE, complete_checkpoints, newest_intact, save_checkpoint
from forge_rl.runtime.manifest import verify
from forge_rl.loop.rollout_tasks import RolloutTasks
from forge_rl.loop.train_loop import RunState, resume_hint
from tests.unit.loop.test_run_folder import garble, write_checkpoint


class Result:
    def __init__(self, value):
        self.value = value

    def item(self, **_):
        return self.value


def endpoint(fn):
    async def call(*args, **kwargs):
        return Result(fn(*args, **kwargs))

    async def call_one(*args, **kwargs):
        return fn(*args, **kwargs)

    return SimpleNamespace(call=call, call_one=call_one)


def trainer_that(fail: bool = False):
    def save(step, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "__0_0.distcp").write_bytes(b"w" * 1000)
        if fail:  # part of the shards written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        (Path(path) / ".metadata").write_bytes(f"step {step}".encode())
        return path

    return SimpleNamespace(save=endpoint(save))


def test_a_failed_save_leaves_earlier_checkpoints_and_keep_last_prunes(tmp_path):
    run = RunState(GRPOConfig())
    buffer = SimpleNamespace(state_dict=endpoint(lambda: {"groups": []}))
    dataset = SimpleNamespace(state_dict=endpoint(lambda: {"position": 7}))

    async def save(step, trainer, keep_last=0):
        return await save_checkpoint(run, trainer, buffer, dataset, step, tmp_path, keep_last, run_id="run-a")

    for step in (1, 2, 3):
        asyncio.run(save(step, trainer_that(), keep_last=2))
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-2", "step-3"]
    before = (tmp_path / "step-3" / ".metadata").read_bytes()

    # the disk fills while step 4 is written, and while step 3 is written again: each ends the run in one line
    # naming the checkpoint to continue from
    with pytest.raises(RunStopped, match=r"checkpoint step-4 not written \(no space left at .*continue from .*step-3"):
        asyncio.run(save(4, trainer_that(fail=True), keep_last=2))
    with pytest.raises(RunStopped, match=r"checkpoint step-3 not written \(no space left at .*continue from .*step-3"):
        asyncio.run(save(3, trainer_that(fail=True), keep_last=2))
    assert complete_checkpoints(tmp_path, "run-a")[-1].name == "step-3"
    assert (tmp_path / "step-3" / ".metadata").read_bytes() == before
    assert torch.load(tmp_path / "step-3" / APP_STATE, weights_only=False)["dataset"] == {"position": 7}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]  # no partial directory left

    asyncio.run(save(3, trainer_that(), keep_last=2))  # saved again, whole: replaced in one piece
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-2", "step-3"]


def test_retention_counts_only_intact_checkpoints_and_never_removes_the_one_just_written(tmp_path):
    """A damaged newer checkpoint (its manifest readable) neither displaces the intact ones nor survives in
    their place: with keep_last=1 the checkpoint just written stays, and resume finds it."""
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, "r", keep_last=2)
    garble(tmp_path / "step-6/__0_0.distcp")
    assert newest_intact(tmp_path, "r")[0].name == "step-4"  # the resume falls back ...
    write_checkpoint(tmp_path, 5, "r", keep_last=1)  # ... and saves step-5 with keep_last=1
    assert (tmp_path / "step-5").is_dir() and verify(tmp_path / "step-5") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5", "step-6"]  # step-4 pruned, the damaged one left
    assert newest_intact(tmp_path, "r")[0].name == "step-5"
    write_checkpoint(tmp_path, 7, "r", keep_last=2)  # damaged ones older than those kept go with the rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5", "step-7"]


def test_resume_hint_names_only_this_runs_newest_intact_checkpoint(tmp_path):
    for step in (1, 2):
        write_checkpoint(tmp_path, step, "mine")
    write_checkpoint(tmp_path, 3, "theirs")
    garble(tmp_path / "step-2/__0_0.distcp")
    assert newest_intact(tmp_path, "mine")[0].name == "step-1"  # the resume that found step-2 damaged
    hint = resume_hint(tmp_path, "mine")
    assert f"checkpoint is {tmp_path / 'step-1'}:" in hint and "step-2" not in hint and "step-3" not in hint
    assert "step-3" not in resume_hint(tmp_path, None) and "no complete checkpoint" in resume_hint(tmp_path, None)


def test_finish_lets_the_rollouts_in_flight_land_before_the_final_checkpoint(tmp_path):
    """finish() must not cancel a rollout that is about to put its group in the buffer: the final checkpoint
    would miss a group whose prompt the data position has passed. A generator that fails at finish's next call
    stops it right after (a fault injected to leave the evaluation and the checkpoint out)."""
    run = RLRun(GRPOConfig(output_dir=str(tmp_path)))
    run.state = RunState(run.cfg)
    run.rollouts = RolloutTasks(run.state, run.timeline)
    landed = []

    class Stopped(Exception):
        pass

    def stop(**_):
        raise Stopped

    async def rollout():
        await run.state.admission.acquire()
        await asyncio.sleep(0.2)  # generating, then scoring
        landed.append("group")
        await run.state.admission.finish(stored=True)

    async def scenario():
        run.rollouts.tasks = [asyncio.create_task(rollout())]
        await asyncio.sleep(0.01)
        run.roles = Roles(None, SimpleNamespace(wait_healthy=stop), None, None, None)
        with pytest.raises(Stopped):
            await run.finish()

    asyncio.run(scenario())
    assert landed == ["group"] and run.state.admission.in_flight == 0


def test_the_summary_of_a_run_never_evaluated_says_so(tmp_path):
    """finish() straight after start() (a notebook): no evaluation, no IndexError."""
    run = RLRun(GRPOConfig(output_dir=str(tmp_path)))
    run.state = RunState(run.cfg)
    buffer = {"added": 0, "trained": 0, "present": 0, "dropped": {"stale": 0}}
    generator = SimpleNamespace(
        version=SimpleNamespace(route=endpoint(lambda: 0).call_one, call_all=endpoint(lambda: [0]).call_one),
        stats=SimpleNamespace(route=endpoint(lambda: {}).call_one),
        service_stats=SimpleNamespace(respawns=0),
    )
    run.roles = Roles(
        trainer=None,
        generator=generator,
        buffer=SimpleNamespace(stats=endpoint(lambda: buffer)),  # read, never emptied
        reward=None,
        dataset=SimpleNamespace(stats=endpoint(lambda: {"too_long": 0})),
    )
    run.placement = SimpleNamespace(describe=lambda: "cpu")
    summary = asyncio.run(run_summary(run, 0.0, 0.0))
    assert summary["eval_first"] is None and summary["eval_last3_mean"] is None and summary["evals"] == []
    summary.update(run_id="r", busy_fraction={})
    block = summary_block(
        summary, "exact_match", tmp_path, tmp_path / "curves.png", tmp_path / "step-0", None, False, None
    )
    assert "not evaluated" in block
