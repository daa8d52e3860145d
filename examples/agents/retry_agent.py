"""An agent written only against the `openai` client: answer, and after a wrong answer hear "Wrong. Try again." and
answer once more. The same task as forge_rl's built-in retry environment (`make demo-multiturn`), here as an agent
that any OpenAI-compatible server could run; forge_rl trains it with

    python -m apps.grpo.main --config configs/grpo/tiny_agent.yaml

which calls `solve` once per episode with the task's example and a client of that episode (docs/agents.md).
Nothing here imports forge_rl: `example` is read for its `messages` and `answer` only.
"""

import asyncio

FEEDBACK = "Wrong. Try again."
CREDIT = (1.0, 0.5)  # a first right answer is worth more than a corrected one; never right: 0


async def solve(example, client, tool_s: float = 0.0) -> float:
    """The episode's reward: CREDIT[k] when try k + 1 is right, else 0. `tool_s`: seconds a tool takes before each
    retry, waiting without work (examples/agents/slow_tool_agent.py)."""
    messages = [dict(m) for m in example.messages]
    for attempt, credit in enumerate(CREDIT):
        if attempt and tool_s:
            await asyncio.sleep(tool_s)
        reply = await client.chat.completions.create(model="tiny-warm", messages=messages)
        text = reply.choices[0].message.content or ""
        if text.strip() == str(example.answer).strip():
            return credit
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FEEDBACK}]
    return 0.0
