"""A verifiers harness that runs its chat loop in the run's own process: verifiers' stock harnesses (`null`, `bash`)
launch a PEP 723 chat program through `uv`, which resolves its packages over the network, and stream their calls,
which the run's endpoint does not serve. verifiers' harness contract allows a loop in-process as long as every model
call goes through the rollout's interception endpoint (verifiers.v1.Harness.launch), so this one does: verifiers
still owns the episode (its taskset's prompt and system prompt, its interception and trace, its stop conditions,
resumed turns, and the scoring by the task's rewards).

`agent.verifiers.harness` names the harness (forge_rl/agents/verifiers_env.py), as `--env.agent.harness.id` would in
verifiers' own CLI. The loop: the conversation so far, one chat completion, repeated while the model calls
tools the task serves over MCP; a reply without tool calls ends the segment.
"""

import json
from contextlib import AsyncExitStack

import httpx

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

__all__ = ["InProcessChatHarness", "InProcessChatConfig"]

MAX_TOOL_ROUNDS = 16  # model calls per segment at most: a model that keeps calling tools ends, its trace as it is
# no read limit (the episode's own time limit, agent.episode_timeout_s, bounds a call); connecting to verifiers'
# interception server, which shares the run's event loop, may wait while that loop is busy: a generous limit and
# the client's retries of a call that never connected, as verifiers' chat program has
CALL_TIMEOUT = httpx.Timeout(None, connect=60.0)
CONNECT_RETRIES = 2


class InProcessChatConfig(vf.HarnessConfig):
    pass


class InProcessChatHarness(vf.Harness[InProcessChatConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the system prompt as a system turn, as the chat program sends it
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True  # a resumed segment relaunches on the conversation so far (Harness.resume)
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
        """One segment of the episode: chat completions through `endpoint` until a reply calls no tool."""
        import openai

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        # plain HTTP on loopback: no certificates to load (loading them is most of a new client's cost)
        http = httpx.AsyncClient(verify=False, timeout=CALL_TIMEOUT)
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=CONNECT_RETRIES, http_client=http)
        async with http, AsyncExitStack() as stack:
            tools, dispatch, servers = [], {}, {}
            if mcp_urls:
                config = {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}
                tools, dispatch, servers = await connect_mcp(config, stack, set())
            for _ in range(MAX_TOOL_ROUNDS):
                kwargs = {"tools": tools} if tools else {}
                completion = await client.chat.completions.create(model=ctx.model, messages=messages, **kwargs)
                message = completion.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls or not dispatch:
                    break
                for call in message.tool_calls:
                    messages.append(await _tool_reply(call, servers, dispatch))
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _tool_reply(call, servers: dict, dispatch: dict) -> dict:
    """The tool turn answering `call`: the MCP tool's result, or what was wrong with the call."""
    name = call.function.name
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as e:
        content = f"error: invalid JSON in tool arguments ({e})"
    else:
        if not isinstance(args, dict):
            content = f"error: tool arguments must be a JSON object, got {type(args).__name__}"
        elif name in dispatch:
            content = await call_mcp(servers, dispatch, name, args)
        else:
            content = f"error: unknown tool {name!r}"
    return {"role": "tool", "tool_call_id": call.id, "name": name, "content": content}
