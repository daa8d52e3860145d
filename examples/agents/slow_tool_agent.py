"""The retry agent (examples/agents/retry_agent.py) with a slow tool: after each wrong answer it waits TOOL_S seconds
before trying again, using no CPU, as an agent waiting on a tool, a sandbox or a web call does. Its episodes spend
most of their time waiting, so the generators stay busy only when enough episodes run at once
(`agent.max_concurrent_episodes`, `rollout_tasks`; docs/agents.md, "Agents that wait"):

    python -m apps.grpo.main --config configs/grpo/tiny_agent.yaml agent.entry=examples.agents.slow_tool_agent:solve
"""

from examples.agents import retry_agent

TOOL_S = 0.5  # the tool's latency, each time the agent uses it


async def solve(example, client) -> float:
    """The retry agent's reward, the tool used before each retry."""
    return await retry_agent.solve(example, client, tool_s=TOOL_S)
