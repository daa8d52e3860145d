"""The episode recorder (forge_rl/agents/episodes.py): a call that repeats an earlier call's conversation continues
its recorded tokens; an edited history, a template that rewrites earlier turns or a branch start trajectories of
their own (or are refused); a group's trajectories share one prompt. The tiny model's tokenizer and Qwen3's
(tests/support/fixtures/qwen3) render the conversations; replies are token ids as an engine would return them."""

import pytest
import torch
from transformers import AutoTokenizer

from forge_rl.agents.conversation import ChatContinuation, template_message
from forge_rl.agents.episodes import (
    EpisodeRecord,
    Refused,
    assistant_message,
    reply_of,
    shared_prompt_len,
    trajectory_completion,
)
from forge_rl.models import model_path
from forge_rl.types import Completion, Episode, Group
from tests.conftest import REPO

QUESTION = [{"role": "user", "content": "What is 12+34?"}]
RETRY = {"role": "user", "content": "Wrong. Try again."}


@pytest.fixture(scope="module")
def tiny():
    return AutoTokenizer.from_pretrained(model_path("tiny-warm"))


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(REPO / "tests/support/fixtures/qwen3")


def sampled(tokenizer, prompt_ids: list[int], text: str, version: int = 0, stop: bool = True) -> Completion:
    """A reply as the generator returns it: `text`'s tokens (then the end-of-turn token), logprobs, versions."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if stop else [])
    return Completion(
        prompt_ids=torch.tensor(prompt_ids),
        response_ids=torch.tensor(ids),
        logprobs=-torch.rand(len(ids)),
        policy_versions=torch.full((len(ids),), version),
        finish_reason="stop" if stop else "length",
        sampling={"temperature": 1.0},
    )


def call(record: EpisodeRecord, tokenizer, messages: list[dict], reply_text: str, **kwargs):
    """One chat call: planned, 'sampled' as `reply_text`, recorded; returns (plan, the message the agent got)."""
    messages = [template_message(m) for m in messages]
    plan = record.plan_chat(messages, None, {})
    completion = sampled(tokenizer, plan.prompt_ids, reply_text, **kwargs)
    message = assistant_message(reply_text, [])
    record.record(
        plan, [reply_of(completion, tokenizer, {tokenizer.eos_token_id}, message, reply_text)], "chat", messages
    )
    return plan, {"role": "assistant", "content": reply_text}


def episode(tokenizer, non_prefix="split", **kwargs) -> EpisodeRecord:
    return EpisodeRecord("t0", None, True, non_prefix, ChatContinuation(tokenizer, **kwargs))


def test_a_second_call_continues_the_first_calls_tokens(tiny):
    record = episode(tiny)
    first, reply = call(record, tiny, QUESTION, "45")
    second, _ = call(record, tiny, [*QUESTION, reply, RETRY], "46")
    sampled_ids = record.trajectories[0].ids[: len(tiny("45")["input_ids"]) + 1]
    assert second.prompt_ids[: len(first.prompt_ids) + len(sampled_ids)] == first.prompt_ids + sampled_ids
    continuation = "\n<|im_start|>user\nWrong. Try again.<|im_end|>\n<|im_start|>assistant\n"
    assert second.inserted == tiny(continuation, add_special_tokens=False)["input_ids"]
    assert second.split is None and len(record.trajectories) == 1 and record.calls == 2
    t = record.trajectories[0]
    assert t.env == [False] * 3 + [True] * len(second.inserted) + [False] * 3  # "45"+eos, continuation, "46"+eos
    assert t.tokens() == second.prompt_ids + tiny("46", add_special_tokens=False)["input_ids"] + [tiny.eos_token_id]


def test_a_reply_cut_off_is_closed_by_the_template(tiny):
    record = episode(tiny)
    call(record, tiny, QUESTION, "4", stop=False)
    second, _ = call(record, tiny, [*QUESTION, {"role": "assistant", "content": "4"}, RETRY], "46")
    assert second.inserted[0] == tiny.eos_token_id and second.split is None


def test_an_edited_history_splits_the_episode(tiny):
    record = episode(tiny)
    first, _ = call(record, tiny, QUESTION, "45")
    edited = {"role": "assistant", "content": "47"}
    second, _ = call(record, tiny, [*QUESTION, edited, RETRY], "46")
    assert second.split and len(record.trajectories) == 2 and record.splits == 1
    rendered = tiny.apply_chat_template([*QUESTION, edited, RETRY], tokenize=False, add_generation_prompt=True)
    assert second.prompt_ids == tiny(rendered, add_special_tokens=False)["input_ids"]  # its own prompt, afresh
    assert record.trajectories[1].env == [False] * 3  # trains only on what it sampled


def test_an_edited_history_is_refused_when_configured(tiny):
    record = episode(tiny, non_prefix="refuse")
    call(record, tiny, QUESTION, "45")
    with pytest.raises(Refused, match="non_prefix: refuse"):
        call(record, tiny, [QUESTION[0], {"role": "assistant", "content": "47"}, RETRY], "46")
    assert record.failure[0] == "agent_non_prefix"


def test_a_compacted_context_splits_the_episode(tiny):
    record = episode(tiny)
    _, reply = call(record, tiny, QUESTION, "45")
    call(record, tiny, [*QUESTION, reply, RETRY], "46")
    second, _ = call(record, tiny, [{"role": "user", "content": "Earlier: 45, wrong. What is 12+34?"}], "46")
    assert second.split and record.splits == 1 and len(record.trajectories) == 2


def test_qwen3_stripping_earlier_reasoning_splits_the_episode(qwen3):
    """Qwen3's template drops the reasoning of turns before the last user message: the model's tokens are not what
    the template would show it, so the next call trains on a trajectory of its own."""
    record = episode(qwen3)
    thought = "<think>\nadd the units\n</think>\n\n45"
    call(record, qwen3, QUESTION, thought)
    second, _ = call(record, qwen3, [*QUESTION, {"role": "assistant", "content": thought}, RETRY], "46")
    assert second.split and "renders an earlier reply other than as the model produced it" in second.split


def test_qwen3_without_thinking_continues(qwen3):
    record = episode(qwen3, enable_thinking=False)
    first, reply = call(record, qwen3, QUESTION, "45")
    second, _ = call(record, qwen3, [*QUESTION, reply, RETRY], "46")
    assert second.split is None
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids  # the empty think block stays as sampled


def test_a_branch_starts_a_trajectory_on_the_exact_tokens(tiny):
    record = episode(tiny)
    first, reply = call(record, tiny, QUESTION, "45")
    a, _ = call(record, tiny, [*QUESTION, reply, RETRY], "46")
    b, _ = call(record, tiny, [*QUESTION, reply, {"role": "user", "content": "Sure?"}], "45")
    assert b.split is None and record.forks == 1 and len(record.trajectories) == 2
    assert b.prompt_ids[: len(first.prompt_ids) + 3] == a.prompt_ids[: len(first.prompt_ids) + 3]
    assert record.trajectories[1].prompt_ids == b.prompt_ids  # the shared reply is context there, trained once


def test_a_group_of_split_episodes_shares_one_prompt(tiny):
    one, two = episode(tiny), episode(tiny)
    _, reply = call(one, tiny, QUESTION, "45")
    call(one, tiny, [*QUESTION, {"role": "assistant", "content": "44"}, RETRY], "46")  # split
    call(two, tiny, QUESTION, "46")
    trajectories = [*one.trajectories, *two.trajectories]
    n = shared_prompt_len(trajectories)
    completions = [trajectory_completion(t, n, tiny) for t in trajectories]
    Group("x", [Episode(c, advantage=0.0) for c in completions])  # one prompt, as a Group requires
    for t, c in zip(trajectories, completions):
        assert c.prompt_ids.tolist() + c.response_ids.tolist() == t.tokens()
        trained = [i for i, e in zip(c.response_ids.tolist(), c.env_mask.tolist()) if not e]
        assert trained == [i for i, e in zip(t.ids, t.env) if not e]  # only the engine's sampled tokens train


def test_a_tool_call_and_its_result_continue_on_the_models_tokens(qwen3):
    """Qwen3 writes a tool call in its Hermes format; the agent sends it back as OpenAI tool_calls and adds the tool's
    result: the template renders the call as the model wrote it, so the episode stays one trajectory."""
    record = episode(qwen3, enable_thinking=False)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    asked = [template_message(m) for m in QUESTION]
    plan = record.plan_chat(asked, tools, {})
    raw = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
    completion = sampled(qwen3, plan.prompt_ids, raw)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 34}'}}
    returned = assistant_message(None, [call])
    record.record(plan, [reply_of(completion, qwen3, {qwen3.eos_token_id}, returned, "")], "chat", asked)
    sent = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]
    sent.append({"role": "tool", "tool_call_id": "call_1", "content": "46"})
    second = record.plan_chat([template_message(m) for m in sent], tools, {})
    assert second.split is None and second.tip is not None
    assert "<tool_response>\n46\n</tool_response>" in qwen3.decode(second.inserted)
    assert second.prompt_ids[: len(plan.prompt_ids) + len(completion.response_ids)] == plan.prompt_ids + (
        completion.response_ids.tolist()
    )
