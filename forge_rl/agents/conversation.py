"""A chat conversation continued on the tokens the model produced, never re-tokenised from text.

An agent sends its whole conversation on every call. When its messages repeat an earlier call's (that call's
messages, then the reply it got), the engine's recorded tokens stand for that part; only what comes after the reply
is rendered by the tokenizer's chat template and tokenised: the end of the model's turn, the new messages (tool
results, user turns) and the opening of the model's next turn. The conversation is rendered whole with each model
turn as a placeholder, and the text after the latest one is the continuation (forge_rl/loop/turn_renderer.py's
TurnRenderer does the same for an environment's turns).

That is only token for token when the template renders every model turn as the model wrote it once more messages
follow. Where it does not (Qwen3 strips the reasoning of turns before the last user message; an agent that edits a
reply), `NotAPrefix` says why, and the episode is split or the call refused (forge_rl/agents/episodes.py).
"""

import json
from typing import Any

_MARK = "\x00forge-rl-agent-turn-{}\x00"


class NotAPrefix(ValueError):
    """A call cannot continue an earlier call's tokens; the message says why."""


def text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, None (a reply made only of tool calls), or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: a content part of type {kind!r}; only text is served")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError(f"{where}: content of type {type(content).__name__}; give a string or text parts")


def _arguments(arguments: Any) -> Any:
    """A tool call's arguments as JSON values when they parse (as vLLM renders them), else as given."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_message(message: dict, where: str = "message") -> dict:
    """`message` as the chat template takes it: text content, tool calls with their arguments parsed."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"{where}: a chat message needs a role")
    out = {"role": message["role"], "content": text_content(message.get("content"), where)}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "id": call.get("id"),
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _arguments(call["function"].get("arguments", {})),
                },
            }
            for call in message["tool_calls"]
        ]
    return out


def same_message(a: dict, b: dict) -> bool:
    """Whether two template messages say the same (a tool call's id aside: the agent may keep or drop it)."""

    def key(m: dict) -> tuple:
        calls = tuple(
            (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
            for c in m.get("tool_calls", ())
        )
        return (m["role"], m["content"], m.get("name"), m.get("tool_call_id"), m.get("reasoning_content"), calls)

    return key(a) == key(b)


class ChatContinuation:
    """Renders conversations with a tokenizer's chat template (`tools` and template arguments per call)."""

    def __init__(self, tokenizer, **chat_template_kwargs):
        self.tokenizer, self.kwargs = tokenizer, chat_template_kwargs
        self.eos = tokenizer.eos_token or ""

    def render(self, messages: list[dict], tools: list | None, kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True, **{**self.kwargs, **kwargs}
        )

    def prompt_ids(self, messages: list[dict], tools: list | None, kwargs: dict) -> list[int]:
        """A conversation's first prompt, rendered and tokenised whole (no earlier tokens to continue)."""
        return self.tokenizer(self.render(messages, tools, kwargs), add_special_tokens=False)["input_ids"]

    def after(
        self,
        conversation: list[dict],
        model_turns: dict[int, str],
        new: list[dict],
        tools: list | None,
        kwargs: dict,
        model_stopped: bool,
    ) -> list[int]:
        """The token ids after the model's last turn in `conversation` up to the opening of its next turn, with
        the `new` messages between. `model_turns`: the position in `conversation` of each of the model's own turns
        and the text it produced there (its last one is the conversation's last message). `model_stopped`: that
        last turn ended with its end-of-turn token, which the engine kept. Raises NotAPrefix when the template
        renders a model turn other than as the model wrote it."""
        marks = {i: _MARK.format(i) for i in model_turns}
        placeholders = [
            {"role": "assistant", "content": marks[i]} if i in marks else m for i, m in enumerate(conversation)
        ]
        full = self.render(placeholders + new, tools, kwargs)
        if any(full.count(mark) != 1 for mark in marks.values()):
            raise NotAPrefix("the chat template drops or repeats earlier assistant turns once more messages follow")
        expected = full
        for i, mark in marks.items():
            expected = expected.replace(mark, model_turns[i])
        real = self.render(conversation + new, tools, kwargs)
        if real != expected:
            at = next((i for i, (a, b) in enumerate(zip(real, expected)) if a != b), min(len(real), len(expected)))
            lo = max(0, at - 30)
            raise NotAPrefix(
                "the conversation renders an earlier reply other than as the model produced it (as produced: "
                f"{expected[lo : at + 40]!r}; as sent: {real[lo : at + 40]!r}): the agent edited it, or the chat "
                "template rewrites earlier turns (Qwen3 strips their reasoning: chat_template_kwargs "
                "enable_thinking: false keeps none)"
            )
        closing = full.split(marks[max(marks)], 1)[1]
        if model_stopped and self.eos and closing.startswith(self.eos):
            closing = closing[len(self.eos) :]
        return self.tokenizer(closing, add_special_tokens=False)["input_ids"]
