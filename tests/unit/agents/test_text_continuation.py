"""/v1/completions calls continued on their recorded tokens (forge_rl/agents/episodes.py's plan_text): the text an
agent got back leaves out the end of the reply's tokens (the end-of-turn token, a stop string), and an agent that
renders the next turn itself sends that end back; the recorded tokens stand for it, so it is never in the prompt
twice. A prompt that leaves it out is not a continuation of those tokens (split, or refused). Replies are token ids
as the engine returns them, on the tiny model's tokenizer."""

import pytest
import torch
from transformers import AutoTokenizer

from forge_rl.agents.conversation import ChatContinuation
from forge_rl.agents.episodes import EpisodeRecord, Refused, reply_of
from forge_rl.models import model_path
from forge_rl.types import Completion

PROMPT = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
NEXT_TURN = "\n<|im_start|>user\nWrong. Try again.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny():
    return AutoTokenizer.from_pretrained(model_path("tiny-warm"))


def text_call(record: EpisodeRecord, tokenizer, prompt: str, sampled: str, eos: bool, returned: str):
    """One text call: planned, 'sampled' as `sampled`'s tokens (then the end-of-turn token if `eos`), recorded
    as returned to the agent (`returned`: the server's text, the end-of-turn token and a stop string left out)."""
    plan = record.plan_text(prompt, tokenizer)
    ids = tokenizer(sampled, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
    completion = Completion(
        prompt_ids=torch.tensor(plan.prompt_ids),
        response_ids=torch.tensor(ids),
        logprobs=-torch.rand(len(ids)),
        policy_versions=torch.zeros(len(ids), dtype=torch.long),
        finish_reason="stop",
        sampling={"temperature": 1.0},
    )
    record.record(plan, [reply_of(completion, tokenizer, {tokenizer.eos_token_id}, None, returned)], "text", prompt)
    return plan


def episode(tokenizer, non_prefix="split") -> EpisodeRecord:
    return EpisodeRecord("t0", None, True, non_prefix, ChatContinuation(tokenizer))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_end_of_turn_token_sent_back_is_not_doubled(tiny):
    record = episode(tiny)
    first = text_call(record, tiny, PROMPT, "45", eos=True, returned="45")
    agent_text = PROMPT + "45" + tiny.eos_token + NEXT_TURN  # the agent's own rendering of the next turn
    second = text_call(record, tiny, agent_text, "46", eos=True, returned="46")
    assert second.split is None and len(record.trajectories) == 1
    assert second.prompt_ids == ids(tiny, agent_text)  # token for token what the agent's text renders
    assert second.prompt_ids.count(tiny.eos_token_id) == 3  # the question's, the reply's and the feedback's
    assert second.prompt_ids[: len(first.prompt_ids) + 3] == first.prompt_ids + ids(tiny, "45") + [tiny.eos_token_id]
    assert second.inserted == ids(tiny, NEXT_TURN)  # only what follows the reply's tokens, masked in training


def test_a_stop_string_sent_back_is_not_doubled(tiny):
    record = episode(tiny)
    text_call(record, tiny, "Q: 12+34=\nA:", " 46\nQ:", eos=False, returned=" 46")  # stop=["\n"]: cut there
    agent_text = "Q: 12+34=\nA: 46\nQ: 1+1=\nA:"
    second = text_call(record, tiny, agent_text, " 2", eos=False, returned=" 2")
    assert second.split is None and second.prompt_ids == ids(tiny, "Q: 12+34=\nA:") + ids(tiny, " 46\nQ:") + ids(
        tiny, " 1+1=\nA:"
    )


def test_a_prompt_that_leaves_out_the_hidden_end_is_not_a_continuation(tiny):
    record = episode(tiny)
    text_call(record, tiny, PROMPT, "45", eos=True, returned="45")
    second = text_call(record, tiny, PROMPT + "45 and more", "6", eos=True, returned="6")
    assert second.split and "'<|im_end|>'" in second.split and len(record.trajectories) == 2
    assert second.prompt_ids == ids(tiny, PROMPT + "45 and more")  # its own prompt, afresh

    refusing = episode(tiny, non_prefix="refuse")
    text_call(refusing, tiny, PROMPT, "45", eos=True, returned="45")
    with pytest.raises(Refused, match="send it back right after that text"):
        text_call(refusing, tiny, PROMPT + "45" + NEXT_TURN, "6", eos=True, returned="6")


def test_a_reply_cut_at_max_tokens_continues_on_its_text(tiny):
    record = episode(tiny)
    record_plan = text_call(record, tiny, "12+34=", "4", eos=False, returned="4")
    second = text_call(record, tiny, "12+34=4 1+1=", "2", eos=False, returned="2")
    assert second.split is None and second.prompt_ids == record_plan.prompt_ids + ids(tiny, "4") + ids(tiny, " 1+1=")
