"""An OpenEnv environment played as a forge_rl multi-turn environment (`env.openenv`, docs/environments.md).

One `OpenEnvTrajectory` per trajectory, over one OpenEnv episode (an instance in this process or a session of a
server: forge_rl/envs/openenv_session.py):

- reset: `reset(seed=..., episode_id=..., **kwargs)`, the seed drawn from the run's seed and the example's id, the
  kwargs `env.openenv.reset_args` and the example's `reset_columns`: every trajectory of a group (and of the
  example's evaluation) starts on the same task. The first observation's text is the prompt (the task's system
  prompt and few-shot turns kept before it); an observation without text leaves the task's own prompt.
- step: the model's reply fills the Action's text field (`env.openenv.action_field`); where the environment has
  MCP tools, a Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the reply is a CallToolAction
  instead and its result comes back as a `tool` turn. The observation's text is the next user turn; its reward
  is the step's, the trajectory's return their sum (multiturn.py keeps each step's).
- limits: each reset and step within `env.openenv.step_timeout_s`; `close` ends the episode however it went.

What fails costs the group (multiturn.py counts it): an environment that raises, hangs (env_timeout), returns a
reward that is not a number (or none at the end: a NaN sent over HTTP arrives as none), or a server that is gone.
A reply the Action type refuses is the model's mistake, not the environment's: its trajectory ends there with
reward 0, and the run says so once.
"""

import asyncio
import hashlib
import json
import math
import re
import uuid
from typing import Any

from forge_rl.envs.environment import EnvError, Environment, EnvStep
from forge_rl.envs.openenv_session import InvalidAction, Seen

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)  # as forge_rl/envs/tools.py's
MCP_TOOL_FIELDS = {"tool_name", "result", "error"}  # a CallToolObservation's fields


class EnvFailure(EnvError):
    """The OpenEnv environment broke its side of a step (multiturn.py drops the group under `reason`)."""


class EnvTimeout(EnvFailure):
    reason = "env_timeout"


def example_seed(run_seed: int, example_id: str) -> int:
    """The reset seed of an example in a run: the same for every trajectory of its group, another for the next
    example or run (OpenEnv's server takes seeds in [0, 2**31))."""
    digest = hashlib.sha256(f"{run_seed}/{example_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def step_reward(value: Any, done: bool) -> float:
    """The step's reward as a finite float; EnvFailure for anything else (none at an episode's end too)."""
    if value is None:
        if done:
            raise EnvFailure("the episode ended with no reward (None; a NaN reward sent over HTTP arrives as None)")
        return 0.0  # OpenEnv's "no reward for this step"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EnvFailure(f"the reward {value!r:.40} ({type(value).__name__}) is not a number")
    if not math.isfinite(value):
        raise EnvFailure(f"the reward is {value} (not a finite number)")
    return float(value)


class Reading:
    """How observations become text and replies become actions, for one configured environment."""

    def __init__(self, action_field: str, observation_field: str | None, has_tools: bool):
        self.action_field, self.observation_field, self.has_tools = action_field, observation_field, has_tools

    def text(self, fields: dict[str, Any]) -> str | None:
        """The observation's text for the model (None: it has none)."""
        if self.observation_field is not None:
            if self.observation_field not in fields:
                raise EnvFailure(
                    f"the observation has no field {self.observation_field!r} (env.openenv.observation_field); "
                    f"it has {sorted(fields)}"
                )
            value = fields[self.observation_field]
            return None if value in (None, "") else value if isinstance(value, str) else json.dumps(value)
        texts = {k: v for k, v in fields.items() if isinstance(v, str)}
        if len(texts) > 1:
            raise EnvFailure(
                f"the observation has several text fields {sorted(texts)}: name one in env.openenv.observation_field"
            )
        return next(iter(texts.values()), None) or None

    def messages(self, seen: Seen, was_tool_call: bool) -> list[dict[str, str]]:
        """The environment's next turn: a tool's result, or the observation's text as the user's."""
        if was_tool_call and MCP_TOOL_FIELDS <= set(seen.fields):
            return [{"role": "tool", "content": tool_text(seen.fields)}]
        text = self.text(seen.fields)
        return [{"role": "user", "content": text}] if text else []

    def action(self, reply: str) -> tuple[dict[str, Any], bool]:
        """The action the reply makes (as JSON for the environment) and whether it is a tool call."""
        call = TOOL_CALL.search(reply) if self.has_tools else None
        if call is None:
            return {self.action_field: reply.strip()}, False
        try:
            payload = json.loads(call.group(1))
            return {"type": "call_tool", "tool_name": payload["name"], "arguments": payload.get("arguments", {})}, True
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InvalidAction(
                f'a tool call is {{"name": ..., "arguments": {{...}}}} ({type(e).__name__}: {e})'
            ) from None


def tool_text(fields: dict[str, Any]) -> str:
    """A CallToolObservation as the text of a tool turn: the tool's text content, data, or error."""
    if fields.get("error"):
        error = fields["error"]
        return f"error: {error.get('message', error) if isinstance(error, dict) else error}"
    result = fields.get("result")
    if isinstance(result, dict):
        if result.get("data") is not None:
            return str(result["data"])
        texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict)]
        if texts:
            return "\n".join(texts)
    return result if isinstance(result, str) else json.dumps(result, default=str)


class OpenEnvTrajectory(Environment):
    """One trajectory over one OpenEnv episode (see the module's docstring)."""

    def __init__(self, factory: Any):
        self.factory = factory  # forge_rl/envs/openenv_factory.py: the run's settings, sessions and counters
        self.session = None
        self.total = 0.0

    async def reset(self, example: Any) -> list[dict[str, str]] | None:
        cfg = self.factory.section
        self.session = self.factory.open_session()
        kwargs = {**cfg.reset_args, **self.factory.reset_columns(example)}
        seed = example_seed(self.factory.run_seed, example.id)
        episode = f"{example.id}-{uuid.uuid4().hex[:8]}"
        seen = await self._timed(self.session.reset(seed=seed, episode_id=episode, **kwargs), "reset")
        if seen.done:
            raise EnvFailure("reset returned an observation that is already done")
        text = self.factory.reading.text(seen.fields)
        if text is None:
            return None  # the task's own prompt
        return [*example.messages[:-1], {"role": "user", "content": text}]

    async def step(self, reply: str) -> EnvStep:
        reading = self.factory.reading
        try:
            action, was_tool_call = reading.action(reply)
            seen = await self._timed(self.session.step(action), "step")
        except InvalidAction as e:
            self.factory.refused_action(e)
            return EnvStep(reward=0.0, done=True)
        reward = step_reward(seen.reward, seen.done)
        self.total += reward
        return EnvStep(
            messages=[] if seen.done else reading.messages(seen, was_tool_call),
            reward=reward,
            done=seen.done,
            solved=self.total > self.factory.section.solved_above,
        )

    async def _timed(self, call, what: str) -> Seen:
        limit = self.factory.section.step_timeout_s
        try:
            return await asyncio.wait_for(call, limit)
        except TimeoutError:
            raise EnvTimeout(f"{what} took longer than env.openenv.step_timeout_s={limit:g} s") from None
        except (InvalidAction, EnvFailure):
            raise
        except Exception as e:
            down = await self.factory.server_down(e)
            raise EnvFailure(down or f"{what} raised {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()
