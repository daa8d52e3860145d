"""A run checkpoint is written whole or not at all: a save that fails midway (a full disk) leaves the earlier
checkpoints as they were, and keep_last prunes only complete ones. The trainer here is a fault injector that
writes files as DCP would and can fail partway; the real trainer's save runs in tests/test_grpo_app.py."""

import asyncio
import errno
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.loop.checkpoint import APP_STATE, complete_checkpoints, save_checkpoint
from forge_rl.loop.train_loop import Run


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
    run = Run(GRPOConfig())
    buffer = SimpleNamespace(state_dict=endpoint(lambda: {"groups": []}))
    dataset = SimpleNamespace(state_dict=endpoint(lambda: {"position": 7}))

    async def save(step, trainer, keep_last=0):
        return await save_checkpoint(run, trainer, buffer, dataset, step, tmp_path, keep_last, run_id="run-a")

    for step in (1, 2, 3):
        asyncio.run(save(step, trainer_that(), keep_last=2))
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-2", "step-3"]
    before = (tmp_path / "step-3" / ".metadata").read_bytes()

    with pytest.raises(OSError, match="No space left"):  # the disk fills while step 4 is written
        asyncio.run(save(4, trainer_that(fail=True), keep_last=2))
    with pytest.raises(OSError, match="No space left"):  # and while step 3 is written again
        asyncio.run(save(3, trainer_that(fail=True), keep_last=2))
    assert complete_checkpoints(tmp_path, "run-a")[-1].name == "step-3"
    assert (tmp_path / "step-3" / ".metadata").read_bytes() == before
    assert torch.load(tmp_path / "step-3" / APP_STATE, weights_only=False)["dataset"] == {"position": 7}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]  # no partial directory left

    asyncio.run(save(3, trainer_that(), keep_last=2))  # saved again, whole: replaced in one piece
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-2", "step-3"]
