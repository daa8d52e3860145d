"""Tool use: the model calls tools in its chat template's style and gets their results back as a turn.

A tool call is the Hermes/Qwen form the Qwen chat templates describe to the model when given `tools`:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*(3+4)"}}
    </tool_call>

The result comes back as a `tool` message (the template renders it, e.g. Qwen3's <tool_response> block).
A reply without a tool call is the final answer, scored by a reward function with the row's columns.
"""

import ast
import asyncio
import json
import operator
import re
from collections.abc import Sequence
from typing import Any

from forge_rl.envs.base import Environment, EnvStep
from forge_rl.errors import ConfigError
from forge_rl.rewards.workers import DEFAULT_MEMORY_MB, default_reward_workers, shared_pool

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


MAX_BITS = 1024  # of an integer the calculator computes: far past any task's arithmetic, and quick to print
MAX_OUTPUT = 2000  # characters of a tool's output the model gets back


def _power(base, exponent):
    """base ** exponent, refused before it is computed when the integer result would exceed MAX_BITS."""
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and abs(base) > 1
        and exponent > 0
        and exponent * (abs(base).bit_length() - 1) > MAX_BITS
    ):
        raise ValueError("result too large")
    return operator.pow(base, exponent)


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        value = (_power if isinstance(node.op, ast.Pow) else _OPS[type(node.op)])(left, right)
    else:
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")
    # Every intermediate is bounded, so nested powers ((9**64)**64)**64 stop here instead of eating the CPU.
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError("result too large")
    return value


def calculator(expression: str) -> str:
    """Arithmetic on numbers: + - * / // % ** and parentheses. Anything else (names, calls, huge powers) is an
    error message for the model, never evaluated; so is every failure (a tool never raises)."""
    try:
        value = _evaluate(ast.parse(str(expression)[:200], mode="eval"))
        text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    except Exception as e:  # noqa: BLE001 - SyntaxError, ZeroDivisionError, OverflowError, RecursionError, ...
        return f"error: {e}"[:MAX_OUTPUT]
    return text[:MAX_OUTPUT]


def python(code: str) -> str:
    """Run Python in the sandbox of the code_tests reward (no network, read-only system, limits); its output."""
    from forge_rl.rewards.sandbox import SandboxLimits, run_sandboxed

    result = run_sandboxed(str(code), SandboxLimits(wall_s=5.0, cpu_s=2))
    out = (result.stdout + result.stderr)[-2000:]
    return out if result.ok else f"{result.reason}: {out}"


TOOLS = {"calculator": calculator, "python": python}

# JSON schemas for the chat template (`tools=` of apply_chat_template), which shows them to the model.
SCHEMAS = {
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in a sandbox and return what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
}


def tool_schemas(names: Any, key: str = "env.args.tools") -> list[dict]:
    """The schemas of the tools `names` names: a list of tool names (keys of TOOLS). Anything else (a scalar, a
    string, an entry that is not a name, an unknown name) is a ConfigError naming `key`, what was given and the
    tools there are."""
    available = sorted(TOOLS)
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise ConfigError(f"{key}={names!r}: give a list of tool names, e.g. [calculator]; available: {available}")
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise ConfigError(f"{key}[{i}]={name!r}: give a tool's name; available: {available}")
    unknown = sorted(set(names) - set(TOOLS))
    if unknown:
        raise ConfigError(f"{key}={list(names)}: unknown tools {unknown}; available: {available}")
    return [SCHEMAS[n] for n in names]


def check_reward(reward: Any, key: str = "env.args.reward") -> None:
    """The reward that scores the final answer: a reward's name (a key of REWARDS, or "package.module:function")
    that imports; a ConfigError naming `key` otherwise."""
    from forge_rl.actors.reward import REWARDS, resolve_reward

    if not isinstance(reward, str):
        raise ConfigError(
            f"{key}={reward!r}: give a reward's name, one of {sorted(REWARDS)} or 'package.module:function'"
        )
    try:
        resolve_reward(reward)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


class ToolEnv(Environment):
    """Each reply either calls a tool (its result is the next turn) or answers (scored by `reward`, done).

    The final answer is scored like the reward actor scores a group: in a worker process, within
    `reward_timeout_s`, under `reward_memory_mb` (forge_rl/rewards/workers.py; the run's settings of the same
    names unless env.args sets them). A reward that fails raises its RewardError from `step`, and the rollout
    drops the group under its reason (reward_timeout, reward_crash, ...)."""

    def __init__(
        self,
        tools: tuple[str, ...] = ("calculator",),
        reward: str = "exact_match",
        reward_timeout_s: float | None = 60.0,
        reward_workers: int | None = None,
        reward_memory_mb: int | None = DEFAULT_MEMORY_MB,
    ):
        from forge_rl.actors.reward import reward_target

        tool_schemas(tools)  # checked again (env_factory's chat_template_kwargs checked them before any engine)
        check_reward(reward)
        self.tools, self.reward_name, self.target = tuple(tools), reward, reward_target(reward)
        self.timeout_s = reward_timeout_s
        # one pool for every trajectory of the run (an environment lives for one)
        self.pool = shared_pool(reward_workers or default_reward_workers(), reward_memory_mb, [self.target])
        self.calls = 0

    @classmethod
    def chat_template_kwargs(
        cls, tools: tuple[str, ...] = ("calculator",), reward: str = "exact_match", **_: Any
    ) -> dict:
        """The tools' schemas (the template describes them to the model). env_factory calls this at the run's
        checks, before any engine starts: a bad env.args.tools or env.args.reward is refused there, not mid-run."""
        check_reward(reward)
        return {"tools": tool_schemas(tools)}

    async def reset(self, example) -> None:
        self.example = example

    async def step(self, reply: str) -> EnvStep:
        call = TOOL_CALL.search(reply)
        if call is None:  # the final answer
            e = self.example
            columns = {k: [v] for k, v in e.columns.items()}
            value = (
                await self.pool.score(
                    self.reward_name,
                    self.target,
                    {},
                    [e.prompt],
                    [reply],
                    self.timeout_s,
                    finish_reason=["stop"],
                    **columns,
                )
            )[0]
            return EnvStep(reward=value, done=True, solved=value > 0)
        self.calls += 1
        return EnvStep(messages=[{"role": "tool", "content": await asyncio.to_thread(self.run_call, call.group(1))}])

    def run_call(self, payload: str) -> str:
        """The tool's output, or an error message the model can read (bad JSON, unknown tool, bad arguments, a
        tool that failed): a tool's failure is the model's to handle, never the run's."""
        try:
            call = json.loads(payload)
            name, arguments = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            return f'error: a tool call is {{"name": ..., "arguments": {{...}}}} ({e})'[:MAX_OUTPUT]
        if name not in self.tools:
            return f"error: no tool {name!r}; tools: {list(self.tools)}"[:MAX_OUTPUT]
        try:
            return str(TOOLS[name](**arguments))[:MAX_OUTPUT]
        except Exception as e:  # noqa: BLE001 - bad arguments, or a tool that broke (a sandbox missing)
            return f"error: {name}: {type(e).__name__}: {e}"[:MAX_OUTPUT]
