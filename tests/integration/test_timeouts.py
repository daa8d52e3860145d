"""A hung rank stops the run within its timeout, with an error that names the role, the operation, the version,
the host and where to resume, instead of a run that waits forever."""

import asyncio
import socket
import time

import pytest

from forge_rl.config import load_config
from forge_rl.recipes.grpo import GRPOConfig, main
from forge_rl.runtime.timeouts import HANG_ENV, StepTimeout, TimeoutsConfig, within
from tests.conftest import REPO


def test_within_names_what_hung_and_the_key():
    async def body():
        with pytest.raises(
            StepTimeout,
            match=r"the X's op to version 3 did not finish within "
            r"timeouts.publish_s=0.2 s; on host h",
        ):
            await within(asyncio.Event().wait(), 0.2, "publish_s", "the X's op to version 3", "on host h")
        assert await within(asyncio.sleep(0, result=7), None, "publish_s", "x", "y") == 7

    asyncio.run(body())
    with pytest.raises(ValueError, match="timeouts.trainer_step_s must be > 0"):
        TimeoutsConfig(trainer_step_s=0)


def test_a_trainer_rank_that_hangs_stops_the_run_within_the_timeout(tmp_path, monkeypatch):
    """Rank 1 of two FSDP ranks hangs in its second train step (a test-only fault, runtime/timeouts.py); rank 0
    waits in a collective. The run stops with the named error once timeouts.trainer_step_s has passed, and says
    to resume from the checkpoint the first step left."""
    monkeypatch.setenv(HANG_ENV, "step:1:2")
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        [
            "batch_groups=2",
            "group_size=4",
            "rollout_tasks=2",
            "eval_size=8",
            "eval_every=0",
            "buffer.capacity=4",
            "generator.sampling.max_tokens=6",
            "steps=3",
            "trainer_procs=2",
            "checkpoint_every=1",
            "timeouts.trainer_step_s=20",
            "timeouts.publish_s=10",
            f"output_dir={tmp_path}",
        ],
    )
    start = time.perf_counter()
    with pytest.raises(StepTimeout) as error:
        asyncio.run(main(cfg))
    message = str(error.value)
    assert (
        "the Trainer's step to version 2 did not finish within timeouts.trainer_step_s + timeouts.publish_s=30 s"
        in message
    )
    assert f"host {socket.gethostname()}" in message and f"{tmp_path}/logs/" in message
    assert f"the last complete checkpoint is {tmp_path}/checkpoints/step-1" in message
    assert time.perf_counter() - start < 240  # start-up, one step, the 20 s timeout and the shutdown
