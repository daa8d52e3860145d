"""The agent a run trains: `agent.entry`, a function written against the `openai` client.

    async def solve(example, client: openai.AsyncOpenAI) -> float | None: ...   # runs in the run's event loop
    def solve(example, client: openai.OpenAI) -> float | None: ...              # runs in a thread of its own

It is called once per episode with the task's example (forge_rl.data.task.TaskExample: prompt, messages, answer,
columns) and a client whose base URL and API key are the episode's (`client.base_url`, `client.api_key`, for code
that makes its own client: e.g. http://127.0.0.1:PORT/episodes/t12/v1/ and forge-rl-episode-t12-..., the only key
that URL takes). It returns the episode's reward, or None to have the run's reward functions
score the episode's last reply. An episode that raises, outlives agent.episode_timeout_s, or returns anything but a
finite number (or None) fails with one line naming it (`EpisodeFailed`).
"""

import asyncio
import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from forge_rl.errors import ConfigError

EXTRA = "pip install 'forge_rl[agents]'"
RETRIES = 2  # the openai client's own retries of a call that failed to connect (its default)


class AgentReward(NamedTuple):
    """A reward with its parts (e.g. a verifiers rubric's per-function scores), which the episode keeps."""

    value: float
    parts: dict[str, float]


class EpisodeFailed(RuntimeError):
    """An episode that ended without a usable reward; `reason` is the counted drop reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def require_openai(key: str = "agent.entry") -> None:
    """The `openai` package, which agents are given a client of: a ConfigError naming the extra when it is missing."""
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError(f"{key} needs the openai package, which is not installed: {EXTRA}") from None


def load_entry(path: str, key: str = "agent.entry") -> Callable:
    """The function `path` ("package.module:function") names, checked to take (example, client)."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"{key}={path!r}: give 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"{key}={path!r}: cannot import {module} ({e})") from None
    except AttributeError:
        raise ConfigError(f"{key}={path!r}: {module} has no {name!r}") from None
    if not callable(fn):
        raise ConfigError(f"{key}={path!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as e:
        raise ConfigError(f"{key}={path!r} must take (example, client): {e}") from None
    except ValueError:  # no signature to read (a builtin): it is called and fails, if it must, per episode
        pass
    return fn


class AgentEntry:
    """Runs the agent's function for one episode at a time: its client, its time limit, its result checked."""

    def __init__(self, path: str, timeout_s: float, max_threads: int, fn: Callable | None = None):
        require_openai()
        self.path, self.fn, self.timeout_s = path, fn or load_entry(path), timeout_s
        # a function, or an object whose __call__ is one (forge_rl/agents/verifiers_env.py's VerifiersEpisodes)
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__)
        # a sync agent's thread; the default executor's few threads would make episodes wait for each other
        self.threads = None if self.is_async else ThreadPoolExecutor(max_threads, thread_name_prefix="agent")
        # every episode's client shares one connection pool: an HTTP client of its own would load the system's CA
        # certificates each time (most of an episode's cost in the run's process, though the endpoint is plain HTTP)
        self._http = None

    async def run(self, example, base_url: str, api_key: str) -> float | AgentReward | None:
        """The agent's reward for one episode (None: score its last reply), or EpisodeFailed. `base_url` and
        `api_key`: the episode's (forge_rl/agents/access.py)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                play = self._async if self.is_async else self._sync
                result = await play(example, self.client(base_url, api_key))
        except TimeoutError:
            raise EpisodeFailed(
                "agent_timeout", f"agent {self.path} did not return within agent.episode_timeout_s={self.timeout_s}"
            ) from None
        except EpisodeFailed:
            raise
        except Exception as e:
            raise EpisodeFailed("agent_error", f"agent {self.path} raised {type(e).__name__}: {e}") from None
        if result is None:
            return None
        parts = None
        if isinstance(result, AgentReward):
            result, parts = result
        if isinstance(result, bool) or not isinstance(result, numbers.Real) or not math.isfinite(float(result)):
            raise EpisodeFailed(
                "agent_reward", f"agent {self.path} returned {result!r:.80}; return a finite number or None"
            )
        return float(result) if parts is None else AgentReward(float(result), parts)

    def client(self, base_url: str, api_key: str):
        """An episode's client: openai.AsyncOpenAI for an async agent, openai.OpenAI for a sync one, on the shared
        connection pool (the episode's requests end with it: cancelled, or refused once the episode is closed)."""
        import openai

        if self._http is None:
            self._http = openai.DefaultAsyncHttpxClient() if self.is_async else openai.DefaultHttpxClient()
        kind = openai.AsyncOpenAI if self.is_async else openai.OpenAI
        return kind(
            base_url=base_url, api_key=api_key, timeout=self.timeout_s, max_retries=RETRIES, http_client=self._http
        )

    async def _async(self, example, client):
        return await self.fn(example, client)

    async def _sync(self, example, client):
        return await asyncio.get_running_loop().run_in_executor(self.threads, self.fn, example, client)

    async def close(self) -> None:
        """The shared connection pool, and the sync agents' threads: none waits for an agent that still runs (its
        episode is closed: every call it makes is refused, and its client times out)."""
        http, self._http = self._http, None
        if http is not None:
            await (http.aclose() if self.is_async else asyncio.to_thread(http.close))
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)
        if (close := getattr(self.fn, "close", None)) is not None:  # the function's own resources (verifiers')
            await close()
