"""A block of awaits that an interrupt does not cut in half: each finishes, and the cancellation comes at the end.

    async with InterruptSafe() as safe:           # Ctrl-C, SIGTERM, a time limit: asyncio cancels the task
        scored = await safe(score(batches))       # ... each awaited call still runs to its end,
        metrics = await safe(train(scored))
        state.version += 1                        # ... the block's own lines run too,
                                                  # and the CancelledError is raised here, after the block

The RL step trains and publishes a version inside one: an interrupt then finds the trainer's version and the
run's in agreement, and the final checkpoint holds the step whole. An exception inside the block ends it as usual.
"""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class InterruptSafe:
    def __init__(self):
        self.cancelled = False  # a cancellation arrived inside the block: raised when it ends

    async def __call__(self, work: Awaitable[T]) -> T:
        """`work`'s result, waited for to its end even when this task is cancelled meanwhile."""
        task = asyncio.ensure_future(work)
        while True:
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.done() and task.cancelled():  # the work itself was cancelled, not the task waiting for it
                    raise
                self.cancelled = True
                asyncio.current_task().uncancel()  # keep waiting; the cancellation is raised at the block's end

    async def __aenter__(self) -> "InterruptSafe":
        return self

    async def __aexit__(self, kind, error, traceback) -> None:
        if self.cancelled and kind is None:
            raise asyncio.CancelledError
