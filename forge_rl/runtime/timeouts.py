"""Timeouts on the training path: a rank that hangs, a collective that never completes, a weight load that
never ends stop the run with an error naming what hung, instead of waiting forever.

Users of every RL stack report weight syncs and collectives that hang with no error (NCCL waits forever by
default). Each call on the path of a train step is awaited with a timeout from `timeouts.*`; the trainer's
process group gets `timeouts.collective_s`, so a rank blocked in an all-gather raises there too. Defaults
are generous: they are for hangs, not for slow steps.
"""

import asyncio
import os
from dataclasses import dataclass
from typing import Any, ClassVar
from collections.abc import Awaitable

from forge_rl.errors import RunStopped

# A test-only fault: "operation:rank:step" (e.g. "step:1:2") makes that trainer rank hang in that
# operation at that step, so a test can check the error arrives within the timeout. Never set in a real run.
HANG_ENV = "FORGE_RL_TEST_HANG"


@dataclass
class TimeoutsConfig:
    RENAMED: ClassVar[dict[str, str]] = {"train_step_s": "trainer_step_s"}  # refused, naming the new key
    trainer_step_s: float = 1800.0  # one step of the trainer (forward, backward, collectives), its publish aside
    reference_s: float = 1800.0  # the reference's (or teacher's) logprobs of a batch
    publish_s: float = 600.0  # the trainer writing one weights version to the weight store
    weight_load_s: float = 900.0  # every generator replica prefetching and swapping to a version
    collective_s: float = 1800.0  # any one collective of the trainer's process group (torch.distributed)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"timeouts.{name} must be > 0 seconds, got {value}")


class StepTimeout(RunStopped):
    """A call on the training path outlived its timeout; the run stops (the message names the role, the
    operation, the version, the host and where to resume)."""


async def within(call: Awaitable, seconds: float | None, key: str, what: str, where: str) -> Any:
    """`await call`, or StepTimeout naming `what` (role, operation, version), `where` (host, resume) and the
    timeouts.`key` that expired. `seconds` None: no timeout."""
    try:
        return await asyncio.wait_for(call, seconds)
    except TimeoutError:
        raise StepTimeout(f"{what} did not finish within timeouts.{key}={seconds:g} s; {where}") from None


async def hang_if_asked(operation: str, rank: int, step: int) -> None:
    """The test-only fault of HANG_ENV: hang here when it names this operation, rank and step."""
    if os.environ.get(HANG_ENV) == f"{operation}:{rank}:{step}":
        await asyncio.Event().wait()
