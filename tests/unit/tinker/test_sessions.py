"""A session that finished or fell silent gives its training clients back; one that keeps beating keeps them."""

import asyncio

from forge_rl.tinker.sessions import Sessions


class Released:
    """Training's release, recorded: (owner, model id prefix) of each call."""

    def __init__(self):
        self.calls = []

    async def release(self, owner: str, prefix: str) -> None:
        self.calls.append((owner, prefix))


def test_silent_and_finished_sessions_are_released_and_beating_ones_kept():
    async def scenario():
        training = Released()
        sessions = Sessions(training)
        for session in ("quiet", "beating", "closed"):
            sessions.touch("user-0", session)
        await sessions.finish("user-0", "closed")
        reaper = asyncio.create_task(sessions.reap(silent_s=0.3, every_s=0.1))
        for _ in range(6):
            sessions.touch("user-0", "beating")
            await asyncio.sleep(0.1)
        reaper.cancel()
        return training.calls

    assert asyncio.run(scenario()) == [("user-0", "closed:"), ("user-0", "quiet:")]
