"""The chat template's tokens between a multi-turn trajectory's model turns, rendered so that the trajectory goes on
token for token (forge_rl/loop/multiturn.py plays the turns).

    renderer = TurnRenderer(tokenizer)
    ids = renderer.between(env_messages, model_stopped=True, reply=text, earlier=turns)
"""

_MARK = "\x00forge-rl-turn-{}\x00"


class TurnRenderer:
    """The tokens the tokenizer's chat template puts after a model turn: the end of that turn, the
    environment's messages, and the opening of the model's next turn.

    The conversation is rendered whole, each model turn standing in as a placeholder, and the text after the
    latest one is the continuation. Templates that re-render earlier turns differently once more messages
    follow (Qwen3 drops the empty think block its generation prompt opened the turn with) are fine: the
    trajectory keeps the tokens as generated and only takes the new suffix. A template that changes what the
    model itself wrote (e.g. strips its reasoning) is refused: no continuation is then token for token."""

    def __init__(self, tokenizer, **chat_template_kwargs):
        self.tokenizer, self.kwargs = tokenizer, chat_template_kwargs
        self.eos = tokenizer.eos_token or ""

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of a prompt an environment posed (its chat messages), ready for the model's turn."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **self.kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, conversation: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}, *conversation], tokenize=False, add_generation_prompt=True, **self.kwargs
        )

    def between(
        self,
        messages: list[dict[str, str]],
        model_stopped: bool,
        reply: str | None = None,
        earlier: list[dict[str, str]] = (),
    ) -> list[int]:
        """Token ids after a model turn that ended with its end-of-turn token (`model_stopped`; the engine
        kept that token) or was cut off (the turn is closed here), up to the start of the next model turn.
        `reply` is the model turn's text and `earlier` the trajectory's turns before it (the model's as
        role assistant, the environment's messages): the template must render every model turn as written."""
        turns = [*earlier, {"role": "assistant", "content": _MARK}]
        marks = [_MARK.format(i) for i in range(len(turns))]
        placeholders = [{**m, "content": marks[i]} if m["role"] == "assistant" else m for i, m in enumerate(turns)]
        mark = marks[-1]
        full = self._render(placeholders + list(messages))
        if any(full.count(m) != 1 for i, m in enumerate(marks) if turns[i]["role"] == "assistant"):
            raise ValueError(
                "the chat template drops or repeats the content of earlier assistant turns once more "
                "messages follow, so a conversation cannot be continued token for token"
            )
        if reply is not None:
            self._check_model_turns_kept(full, marks, [*earlier, {"role": "assistant", "content": reply}], messages)
        closing = full.split(mark, 1)[1]
        if model_stopped and self.eos and closing.startswith(self.eos):
            closing = closing[len(self.eos) :]
        return self.tokenizer(closing, add_special_tokens=False)["input_ids"]

    def _check_model_turns_kept(
        self, full: str, marks: list[str], turns: list[dict[str, str]], messages: list[dict[str, str]]
    ) -> None:
        """Raise if the template renders a model turn other than as written once more messages follow."""
        expected = full
        for i, m in enumerate(turns):
            if m["role"] == "assistant":
                expected = expected.replace(marks[i], m["content"])
        real = self._render(turns + list(messages))
        if real == expected:
            return
        at = next((i for i, (a, b) in enumerate(zip(real, expected)) if a != b), min(len(real), len(expected)))
        lo = max(0, at - 40)
        raise ValueError(
            "the chat template rewrites earlier assistant turns: once more messages follow, the model's own "
            f"tokens render differently (as generated: {expected[lo : at + 60]!r}; "
            f"re-rendered: {real[lo : at + 60]!r}), "
            "so a conversation cannot be continued token for token (e.g. Qwen3 strips the reasoning of earlier "
            "turns: set chat_template_kwargs enable_thinking: false, or use a template that keeps it)"
        )
