"""Endpoint calls whose replies come back over one long-lived port, for the calls a run makes per group.

Monarch 0.7.0 keeps native memory in the caller for every call that takes a reply (`call_one`, `call`,
`route`): its reply port is never freed. The GRPO controller makes four such calls per group (the prompt, the
generation, the scores, the buffer add), so with them its memory would grow with every step. A one-way
`broadcast` whose result is sent back over a port opened once keeps a small fraction of that per call.

    example = await replies().call(dataset, PromptDataset.next)      # as `await dataset.next.call_one()`

The actor runs the endpoint through `ForgeActor.reply_to` (concurrently exactly when the endpoint itself is a
concurrent endpoint) and sends `(request id, ok, result or exception)` to the port. A reply that takes longer
than `probe_s` makes the caller check the actor with an ordinary call to `alive`, so an actor whose process
died still raises Monarch's SupervisionError, as a direct call would.
"""

import asyncio
import itertools
import pickle
import weakref
from typing import Any

from monarch.actor import ActorError, Channel

from forge_rl.deps.monarch import ConcurrentEndpointProperty, EndpointProperty, endpoint_function, endpoint_name

_per_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Replies]" = weakref.WeakKeyDictionary()


def replies() -> "Replies":
    """The running event loop's Replies (a port is read by one loop; tests and notebooks run several)."""
    loop = asyncio.get_running_loop()
    if loop not in _per_loop:
        _per_loop[loop] = Replies()
    return _per_loop[loop]


class Replies:
    """One reply port per controller event loop, shared by every call made through it."""

    def __init__(self, probe_s: float = 5.0):
        self.probe_s = probe_s
        self.port, self._receiver = Channel.open()
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None

    async def call(self, actor, endpoint: EndpointProperty, *args: Any, **kwargs: Any) -> Any:
        """`await actor.<endpoint>.call_one(*args, **kwargs)` for `endpoint` the actor class's (`ReplayBuffer.add`),
        the reply over this port when `actor` is a one-proc ForgeActor mesh (anything else, a plain Monarch actor
        included, is called directly)."""
        return await self.call_named(actor, endpoint_name(endpoint), *args, **kwargs)

    async def call_named(self, actor, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        """`call` by the endpoint's name: for the runtime's Service, whose endpoints are reached by name."""
        if not hasattr(getattr(actor, "_class", None), "reply_to"):
            return await getattr(actor, endpoint).call_one(*args, **kwargs)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        request = next(self._ids)
        reply = asyncio.get_running_loop().create_future()
        self._pending[request] = reply
        relay = actor.reply_to_concurrently if is_concurrent(actor._class, endpoint) else actor.reply_to
        try:
            relay.broadcast(self.port, request, endpoint, args, kwargs)
            while True:
                done, _ = await asyncio.wait({reply}, timeout=self.probe_s)
                if done:
                    break
                await actor.alive.call_one()  # a dead actor raises SupervisionError here
        finally:
            self._pending.pop(request, None)
        ok, value = reply.result()
        if not ok:
            raise value
        return value

    async def _read(self) -> None:
        try:
            while True:
                request, ok, value = await self._receiver.recv()
                reply = self._pending.get(request)
                if reply is not None and not reply.done():
                    reply.set_result((ok, value))
        except Exception as e:  # the port broke: fail every waiting call rather than leave it waiting
            for reply in self._pending.values():
                if not reply.done():
                    reply.set_result((False, RuntimeError(f"the reply port stopped: {e!r}")))
            raise


def is_concurrent(actor_cls: type, endpoint: str) -> bool:
    return isinstance(getattr(actor_cls, endpoint, None), ConcurrentEndpointProperty)


async def run_and_reply(actor, port, request: int, endpoint: str, args: tuple, kwargs: dict) -> None:
    """The actor side: run `endpoint` and send its result, or the exception it raised (in an ActorError), to
    `port`."""
    # a concurrent endpoint's method is Monarch's wrapper that replies on its own port; run what it wraps
    method = endpoint_function(getattr(type(actor), endpoint))
    try:
        message = (request, True, await method(actor, *args, **kwargs))
    except Exception as e:  # the caller raises it: an ActorError with the remote traceback, as a direct call's
        message = (request, False, ActorError(e, f"Actor call {type(actor).__name__}.{endpoint} failed."))
    try:
        pickle.dumps(message[2])
    except Exception as e:
        message = (
            request,
            False,
            ActorError(
                RuntimeError(
                    f"{endpoint}: its {'result' if message[1] else 'error'} {message[2]!r} cannot be sent back ({e})"
                )
            ),
        )
    port.send(message)
