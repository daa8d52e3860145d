"""Client sessions and their heartbeats: the `tinker` client sends one every 10 s while its ServiceClient lives. A
session that finished (the client's close) or fell silent (a script that exited without closing, a killed
notebook kernel) gives its training clients' trainers and slots back."""

import asyncio
import time

SILENT_S = 120.0  # twelve missed heartbeats
CHECK_EVERY_S = 30.0


class Sessions:
    def __init__(self, training):
        self.training = training
        self.last_seen: dict[tuple[str, str], float] = {}  # (owner, session id) -> its last heartbeat

    def touch(self, owner: str, session_id: str) -> None:
        self.last_seen[(owner, session_id)] = time.monotonic()

    async def finish(self, owner: str, session_id: str) -> None:
        self.last_seen.pop((owner, session_id), None)
        await self.training.release(owner, f"{session_id}:")

    async def reap(self, silent_s: float = SILENT_S, every_s: float = CHECK_EVERY_S) -> None:
        """Forever: finish the sessions silent for longer than `silent_s`."""
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for owner, session_id in [k for k, seen in self.last_seen.items() if now - seen > silent_s]:
                await self.finish(owner, session_id)
