"""The RL step's interrupt-safe part: a cancellation inside it lets every awaited call and line of the block finish,
then ends the task as cancelled; outside it, a cancellation acts at once."""

import asyncio

import pytest

from forge_rl.runtime.interrupt_safe import InterruptSafe


async def _step(done: list[str]) -> None:
    await asyncio.sleep(0.01)
    done.append("collected")
    async with InterruptSafe() as safe:
        await safe(_work(done, "trained"))
        await safe(_work(done, "published"))
        done.append("version moved on")
    done.append("line logged")


async def _work(done: list[str], what: str) -> None:
    await asyncio.sleep(0.05)
    done.append(what)


@pytest.mark.parametrize("cancel_after_s, finished", [(0.03, True), (0.08, True), (0.0, False)])
def test_a_cancellation_inside_the_block_waits_for_the_block_to_finish(cancel_after_s, finished):
    done: list[str] = []

    async def main() -> None:
        task = asyncio.create_task(_step(done))
        await asyncio.sleep(cancel_after_s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    asyncio.run(main())
    # cancelled before the block: nothing of it ran; inside it: all of it, and nothing after it
    expected = ["collected", "trained", "published", "version moved on"]
    assert done == (expected if finished else [])


def test_without_a_cancellation_the_block_runs_through_and_an_error_inside_ends_it():
    done: list[str] = []
    asyncio.run(_step(done))
    assert done == ["collected", "trained", "published", "version moved on", "line logged"]

    async def failing() -> None:
        async with InterruptSafe() as safe:
            await safe(asyncio.sleep(0))
            raise ValueError("a rank failed")

    with pytest.raises(ValueError, match="a rank failed"):
        asyncio.run(failing())


def test_work_cancelled_on_its_own_is_not_waited_for_again():
    async def main() -> None:
        async with InterruptSafe() as safe:
            work = asyncio.ensure_future(asyncio.sleep(10))
            asyncio.get_running_loop().call_later(0.01, work.cancel)
            await safe(work)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
