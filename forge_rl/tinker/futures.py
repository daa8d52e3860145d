"""Requests as futures, the Tinker way: a call returns a request id at once, and the client polls
`retrieve_future` until the result is ready. Each request is an asyncio task; a poll waits for it up to a bound
and otherwise answers "try again", so a client's poll costs one round trip per bound, not a busy loop.

Ordering is the caller's: a training client's calls are started in the order they arrive and each takes its
model's lock in turn (forge_rl/tinker/models.py).
"""

import asyncio
import itertools
import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from forge_rl.tinker.errors import Refused

logger = logging.getLogger(__name__)

POLL_WAIT_S = 20.0  # below the client's 45 s timeout of a poll


@dataclass
class Outcome:
    """What a poll answers: a JSON body, protobuf bytes, a failure (one line, the user's or the server's), or
    nothing yet."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    user_error: bool = True
    pending: bool = False


class Futures:
    def __init__(self):
        self._ids = itertools.count(1)
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}  # request id -> (its owner, its task)

    def submit(self, owner: str, work: Awaitable) -> str:
        """Start `work` (a coroutine returning a dict or bytes) and return its request id."""
        request_id = f"req-{next(self._ids)}"
        self._tasks[request_id] = (owner, asyncio.ensure_future(work))
        return request_id

    async def retrieve(self, owner: str, request_id: str, wait_s: float = POLL_WAIT_S) -> Outcome:
        """The request's outcome once it is done (then forgotten), or pending after `wait_s`. Another owner's
        request is as unknown as one that never existed."""
        found = self._tasks.get(request_id)
        if found is None or found[0] != owner:
            return Outcome(error=f"no request {request_id!r} of this key (retrieved already, or never made)")
        task = found[1]
        await asyncio.wait([task], timeout=wait_s)
        if not task.done():
            return Outcome(pending=True)
        del self._tasks[request_id]
        if task.cancelled():
            return Outcome(error=f"request {request_id} was cancelled", user_error=False)
        error = task.exception()
        if isinstance(error, Refused):
            return Outcome(error=str(error))
        if error is not None:  # the server's failure: the client gets its first line, the service's log all of it
            logger.error("request %s failed", request_id, exc_info=error)
            return Outcome(
                error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", user_error=False
            )
        result = task.result()
        return Outcome(proto=result) if isinstance(result, bytes) else Outcome(json=result)

    def cancel(self, owner: str, request_id: str) -> None:
        found = self._tasks.pop(request_id, None)
        if found is not None and found[0] == owner:
            found[1].cancel()

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
