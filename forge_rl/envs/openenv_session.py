"""One OpenEnv episode's connection: an environment instance in this process, or a WebSocket session of a server.

Both answer `reset(**kwargs)` and `step(action)` (the action as the JSON object the server would get) with a
`Seen`: the observation's fields, its reward and done, as OpenEnv's server sends them (reward, done and metadata
taken out of the fields). forge_rl/envs/openenv.py turns them into turns and rewards.

In process, the environment's synchronous reset/step run on a daemon thread of the episode's own (OpenEnv's
server gives each session a thread of its own too), never on the event loop; one that hangs past the step's
time limit is abandoned there and dies with the process, where a pool's thread would hold up its exit.
"""

import asyncio
import inspect
import queue
import threading
from dataclasses import dataclass
from typing import Any

from openenv.core import GenericEnvClient
from openenv.core.env_server import Environment as OpenEnvEnvironment
from openenv.core.env_server import CallToolAction, ListToolsAction
from pydantic import ValidationError
from websockets.exceptions import ConnectionClosed

MCP_ACTIONS = {"list_tools": ListToolsAction, "call_tool": CallToolAction}
CONNECT_TIMEOUT_S = 10.0


def connection_lost(error: BaseException) -> bool:
    """Whether `error` says the connection to an OpenEnv server broke (the server may have died), rather than
    that one of its calls failed."""
    return isinstance(error, (OSError, ConnectionClosed))


@dataclass
class Seen:
    """An observation as a served environment sends it: its own fields, its reward and whether it is done."""

    fields: dict[str, Any]
    reward: Any
    done: bool


class InvalidAction(ValueError):
    """The environment's Action type refused the action made from the model's reply (the model's mistake)."""


class _Thread:
    """A daemon thread that runs one episode's calls in order; `call` awaits one from the event loop."""

    def __init__(self, name: str):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # calls put and not yet finished (one still running after its caller gave up: hung)
        threading.Thread(target=self._run, daemon=True, name=name).start()

    async def call(self, fn, *args, **kwargs) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending += 1
        self.calls.put((fn, args, kwargs, loop, future))
        return await future

    def stop(self) -> None:
        self.calls.put(None)

    def _run(self) -> None:
        while (item := self.calls.get()) is not None:
            fn, args, kwargs, loop, future = item
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                result, error = None, e
            self.pending -= 1
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop closed while the call ran: nobody waits for it
                return


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting (the step's time limit)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _overrides(env: OpenEnvEnvironment, name: str) -> bool:
    """Whether the environment has its own async `name` (reset_async, step_async), as OpenEnv's server checks."""
    return getattr(type(env), name) is not getattr(OpenEnvEnvironment, name)


def _seen(observation: Any) -> Seen:
    if not hasattr(observation, "model_dump"):
        raise TypeError(f"returned {type(observation).__name__}, not an openenv Observation")
    fields = observation.model_dump(exclude={"reward", "done", "metadata"})
    return Seen(fields, getattr(observation, "reward", None), bool(getattr(observation, "done", False)))


class InProcessSession:
    """An instance of the environment's class, in this process."""

    def __init__(self, cls: type, args: dict[str, Any], action_cls: type):
        self.cls, self.args, self.action_cls = cls, args, action_cls
        self.thread = _Thread(f"openenv {cls.__name__}")
        self.env: OpenEnvEnvironment | None = None

    async def reset(self, **kwargs: Any) -> Seen:
        self.env = await self.thread.call(self.cls, **self.args)
        if _overrides(self.env, "reset_async"):
            return _seen(await self.env.reset_async(**kwargs))
        return _seen(await self.thread.call(self.env.reset, **kwargs))

    async def step(self, action: dict[str, Any]) -> Seen:
        cls = MCP_ACTIONS.get(action.get("type"), self.action_cls)
        try:
            typed = cls.model_validate(action)
        except ValidationError as e:
            raise InvalidAction(f"{cls.__name__} refused {action!r:.80}: {e.errors()[0]['msg']}") from None
        if _overrides(self.env, "step_async"):
            return _seen(await self.env.step_async(typed))
        return _seen(await self.thread.call(self.env.step, typed))

    async def close(self) -> None:
        """The environment's close, on its thread; none while a call that timed out still runs there (the
        environment is stuck inside it, and its thread is abandoned)."""
        try:
            if self.env is not None and not self.thread.pending:
                await asyncio.wait_for(self.thread.call(self.env.close), CONNECT_TIMEOUT_S)
        finally:
            self.thread.stop()


class RemoteSession:
    """A WebSocket session of an OpenEnv server (openenv's GenericEnvClient): an environment instance of its own
    there, for this episode."""

    def __init__(self, url: str, message_timeout_s: float):
        self.url = url
        self.client = GenericEnvClient(
            base_url=url, connect_timeout_s=CONNECT_TIMEOUT_S, message_timeout_s=message_timeout_s
        )

    async def reset(self, **kwargs: Any) -> Seen:
        try:
            await self.client.connect()
        except ConnectionError as e:
            raise ConnectionError(f"cannot reach the OpenEnv server at {self.url}: {e.__cause__ or e}") from None
        return self._seen(await self.client.reset(**kwargs))

    async def step(self, action: dict[str, Any]) -> Seen:
        try:
            return self._seen(await self.client.step(action))
        except RuntimeError as e:
            if "VALIDATION_ERROR" in str(e):  # the server's Action type refused it (openenv's error code)
                raise InvalidAction(f"the server's Action refused {action!r:.80}") from None
            raise

    @staticmethod
    def _seen(result: Any) -> Seen:
        return Seen(dict(result.observation or {}), result.reward, bool(result.done))

    async def close(self) -> None:
        await asyncio.wait_for(self.client.close(), CONNECT_TIMEOUT_S)


def accepted_keywords(fn) -> set[str] | None:
    """The keyword arguments `fn` takes (None: any, it has **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
