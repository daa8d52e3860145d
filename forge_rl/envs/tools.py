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

from forge_rl.envs.base import Environment, EnvStep

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Arithmetic on numbers: + - * / // % ** and parentheses. Anything else (names, calls, huge powers) is an
    error message for the model, never evaluated."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        value = ev(ast.parse(str(expression)[:200], mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {e}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def python(code: str) -> str:
    """Run Python in the sandbox of the code_tests reward (no network, read-only system, limits); its output."""
    from forge_rl.rewards.sandbox import SandboxLimits, run_sandboxed

    result = run_sandboxed(str(code), SandboxLimits(wall_s=5.0, cpu_s=2))
    out = (result.stdout + result.stderr)[-2000:]
    return out if result.ok else f"{result.reason}: {out}"


TOOLS = {"calculator": calculator, "python": python}

# JSON schemas for the chat template (`tools=` of apply_chat_template), which shows them to the model.
SCHEMAS = {
    "calculator": {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run Python code in a sandbox and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
}


def tool_schemas(names: list[str]) -> list[dict]:
    unknown = sorted(set(names) - set(TOOLS))
    if unknown:
        raise ValueError(f"unknown tools {unknown}; available: {sorted(TOOLS)}")
    return [SCHEMAS[n] for n in names]


class ToolEnv(Environment):
    """Each reply either calls a tool (its result is the next turn) or answers (scored by `reward`, done)."""

    def __init__(self, tools: tuple[str, ...] = ("calculator",), reward: str = "exact_match"):
        from forge_rl.actors.reward import resolve_reward

        tool_schemas(list(tools))  # unknown names fail when the env is built, not mid-run
        self.tools, self.reward_name, self.reward = tuple(tools), reward, resolve_reward(reward)
        self.calls = 0

    @classmethod
    def chat_template_kwargs(cls, tools: tuple[str, ...] = ("calculator",), **_) -> dict:
        return {"tools": tool_schemas(list(tools))}  # the template describes them to the model

    async def reset(self, example) -> None:
        self.example = example

    async def step(self, reply: str) -> EnvStep:
        call = TOOL_CALL.search(reply)
        if call is None:  # the final answer
            e = self.example
            kwargs = {**e.columns, "finish_reason": "stop"}
            value = float(self.reward([e.prompt], [reply], **{k: [v] for k, v in kwargs.items()})[0])
            return EnvStep(reward=value, done=True, solved=value > 0)
        self.calls += 1
        return EnvStep(messages=[{"role": "tool", "content": await asyncio.to_thread(self.run_call, call.group(1))}])

    def run_call(self, payload: str) -> str:
        """The tool's output, or an error message the model can read (bad JSON, unknown tool, bad arguments)."""
        try:
            call = json.loads(payload)
            name, arguments = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            return f"error: a tool call is {{\"name\": ..., \"arguments\": {{...}}}} ({e})"
        if name not in self.tools:
            return f"error: no tool {name!r}; tools: {list(self.tools)}"
        try:
            return TOOLS[name](**arguments)
        except TypeError as e:
            return f"error: {name}: {e}"
