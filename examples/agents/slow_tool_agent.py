"""The retry agent (examples/agents/retry_agent.py) with a slow tool: after each wrong answer it waits TOOL_S seconds
before trying again, using no CPU, as an agent waiting on a tool, a sandbox or a web call does. Its episodes spend
most of their time waiting, so the generators stay busy only when enough episodes run at once
(`agent.max_concurrent_episodes`, `rollout_tasks`; docs/agents.md, "Agents that wait"):

    python -m apps.grpo.main --config configs/grpo/tiny_agent.yaml agent.entry=examples.agents.slow_tool_agent:solve
"""

import asyncio

from examples.agents.retry_agent import CREDIT, FEEDBACK

TOOL_S = 0.5  # the tool's latency, each time the agent uses it


async def solve(example, client) -> float:
    """The episode's reward: CREDIT[k] when try k + 1 is right, else 0; the tool is used before each retry."""
    messages = [dict(m) for m in example.messages]
    for attempt, credit in enumerate(CREDIT):
        if attempt:
            await asyncio.sleep(TOOL_S)  # the tool: a wait, not work
        reply = await client.chat.completions.create(model="tiny-warm", messages=messages)
        text = reply.choices[0].message.content or ""
        if text.strip() == str(example.answer).strip():
            return credit
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FEEDBACK}]
    return 0.0
