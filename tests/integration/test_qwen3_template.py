"""Multi-turn rollouts on Qwen3's real chat template and vocabulary (tests/support/fixtures/qwen3): Qwen3 renders an
assistant turn with the empty think block of its no-thinking generation prompt only while it is the last turn,
so the trajectory keeps its tokens as generated and takes only the rendered suffix; a template that rewrites
what the model wrote (Qwen3 stripping the reasoning of turns before the latest user message) is refused."""

import asyncio
import hashlib

import pytest
import torch

from forge_rl.envs.tools import ToolEnv
from forge_rl.loop.turn_renderer import TurnRenderer
from tests.support.qwen3_fixture import FIXTURE, IM_END, qwen3_model_dir, qwen3_tokenizer  # noqa: F401 (a fixture)

THINK = "<think>\n\n</think>\n\n"
OPEN = "<|im_start|>assistant\n"
USER = [{"role": "user", "content": "12+34="}]
FEEDBACK = [{"role": "user", "content": "Wrong. Try again."}]
TOOL_RESULT = [{"role": "tool", "content": "46"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+34"}}\n</tool_call>'
# sha256 of Qwen/Qwen3-0.6B's files as published (tests/support/fixtures/qwen3/SOURCE.md)
SHA256 = {
    "vocab.json": "ca10d7e9fb3ed18575dd1e277a2579c16d108e32f27439684afa0e10b1440910",
    "merges.txt": "8831e4f1a044471340f7c0a83d7bd71306a5b867e95fd870f74d0c5308a904d5",
    "tokenizer_config.json": "d5d09f07b48c3086c508b30d1c9114bd1189145b74e982a265350c923acd8101",
}


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_tokenizer()


def test_the_fixture_is_qwen3s_tokenizer(tokenizer):
    for name, digest in SHA256.items():
        assert hashlib.sha256((FIXTURE / name).read_bytes()).hexdigest() == digest, name
    assert len(tokenizer) == 151_669 and tokenizer.eos_token_id == IM_END
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [151_667, 151_668]


def build_turn_by_turn(tokenizer, renderer, env_messages, replies, **kwargs):
    """Token ids of prompt, reply, the environment's turn, reply (cut off), the environment's turn: what `play`
    builds, the first reply ending with <|im_end|> (the engine keeps it), the second cut off at max_tokens."""
    text = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    earlier = []
    for reply, stopped in zip(replies, (True, False)):
        ids += tokenizer(reply, add_special_tokens=False)["input_ids"] + ([IM_END] if stopped else [])
        ids += renderer.between(env_messages, model_stopped=stopped, reply=reply, earlier=earlier)
        earlier += [{"role": "assistant", "content": reply}, *env_messages]
    whole = tokenizer.apply_chat_template(USER + earlier, tokenize=False, add_generation_prompt=True, **kwargs)
    return ids, whole


@pytest.mark.parametrize(
    "env_messages, kwargs", [(FEEDBACK, {}), (TOOL_RESULT, ToolEnv.chat_template_kwargs())], ids=["retry", "tools"]
)
def test_without_thinking_the_sequence_keeps_the_think_blocks_it_was_generated_with(tokenizer, env_messages, kwargs):
    kwargs = {**kwargs, "enable_thinking": False}
    replies = ["45", "4"] if env_messages is FEEDBACK else [CALL, "4"]
    ids, whole = build_turn_by_turn(tokenizer, TurnRenderer(tokenizer, **kwargs), env_messages, replies, **kwargs)
    # the template renders earlier model turns without the empty think block their generation prompt had ...
    assert whole.count(THINK) == 1 and whole.endswith(OPEN + THINK)
    # ... the trajectory keeps it: every model turn follows the generation prompt it was sampled after
    head, last = whole.rsplit(OPEN + THINK, 1)
    as_generated = head.replace(OPEN, OPEN + THINK) + OPEN + THINK + last
    assert tokenizer.decode(ids) == as_generated and as_generated.count(THINK) == 3
    assert ids == tokenizer(as_generated, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "env_messages, replies, kwargs",
    [
        (FEEDBACK, ["45", "4"], {}),
        (
            TOOL_RESULT,
            ["<think>\nAdd with the tool.\n</think>\n\n" + CALL, "<think>\nIt said 46"],
            ToolEnv.chat_template_kwargs(),
        ),
    ],
    ids=["retry-without-reasoning", "tools-with-reasoning"],
)
def test_with_thinking_the_sequence_is_the_templates_whole_conversation(tokenizer, env_messages, replies, kwargs):
    ids, whole = build_turn_by_turn(tokenizer, TurnRenderer(tokenizer, **kwargs), env_messages, replies, **kwargs)
    assert tokenizer.decode(ids) == whole  # the template keeps these earlier turns as the model wrote them
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]


def test_a_template_rewriting_the_models_own_tokens_is_refused(tokenizer):
    """Thinking on, a user turn after the reply: Qwen3 strips the reasoning of turns before the latest user
    message, which would change tokens the model generated."""
    renderer = TurnRenderer(tokenizer)
    with pytest.raises(ValueError, match="the chat template rewrites earlier assistant turns") as e:
        renderer.between(FEEDBACK, model_stopped=True, reply="<think>\nSum.\n</think>\n\n45")
    assert "<think>\\nSum.\\n</think>\\n\\n45<|im_end|>" in str(e.value)  # as generated
    assert "assistant\\n45<|im_end|>" in str(e.value)  # as the template re-renders it
    # a later reply re-renders an earlier turn too: checked for every model turn of the trajectory
    earlier = [{"role": "assistant", "content": "<think>\nSum.\n</think>\n\n45"}, *TOOL_RESULT]
    with pytest.raises(ValueError, match="rewrites earlier assistant turns"):
        renderer.between(FEEDBACK, model_stopped=True, reply="46", earlier=earlier)


def model_and_env_segments(completion):
    """(model tokens, environment tokens) pairs of a trajectory's response, in order."""
    mask, ids, pairs = completion.env_mask.tolist(), completion.response_ids.tolist(), []
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and not mask[j]:
            j += 1
        k = j
        while k < len(ids) and mask[k]:
            k += 1
        pairs.append((ids[i:j], ids[j:k]))
        i = k
    return pairs


def test_multi_turn_grpo_on_the_real_template_and_vocabulary(qwen3_model_dir, tmp_path):  # noqa: F811
    """A short GRPO run with the retry environment on a random Qwen3 with the real vocabulary (vLLM CPU, Monarch,
    TorchTitan), thinking off: every stored trajectory continues token for token as the template renders it."""
    from forge_rl.config import load_config
    from forge_rl.observability.metrics import read_jsonl
    from forge_rl.recipes.grpo import GRPOConfig, main
    from tests.conftest import REPO

    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny_retry.yaml",
        [
            f"model={qwen3_model_dir}",
            "steps=2",
            "batch_groups=2",
            "group_size=2",
            "rollout_tasks=2",
            "eval_size=4",
            "eval_every=0",
            "buffer.capacity=8",
            "buffer.drop_zero_advantage=false",
            "generator.sampling.max_tokens=8",
            "chat_template_kwargs.enable_thinking=false",
            "generator.engine_args.max_model_len=512",
            "checkpoint_every=1",
            f"output_dir={tmp_path}",
        ],
    )
    summary = asyncio.run(main(cfg))
    assert summary["trainer_version"] == 2
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert any("eval/accuracy" in r and "eval/first_turn" in r for r in rows)
    tokenizer = qwen3_tokenizer()
    renderer = TurnRenderer(tokenizer, enable_thinking=False)
    episodes = [
        e
        for p in sorted((tmp_path / "checkpoints").glob("step-*"))
        for g, _ in torch.load(p / "app_state.pt", weights_only=False)["buffer"]["entries"]
        for e in g.episodes
    ]
    multi = [e.completion for e in episodes if e.completion.env_mask.any()]
    assert multi, "no stored trajectory had an environment turn"
    for c in multi:
        assert tokenizer.decode(c.prompt_ids).endswith(OPEN + THINK)
        earlier = []
        for model_ids, env_ids in model_and_env_segments(c):
            if not env_ids:
                continue
            reply = tokenizer.decode(model_ids, skip_special_tokens=True)
            stopped = bool(model_ids) and model_ids[-1] == IM_END
            assert env_ids == renderer.between(FEEDBACK, model_stopped=stopped, reply=reply, earlier=earlier)
            closing = "" if stopped else "<|im_end|>"
            feedback = f"{closing}\n<|im_start|>user\nWrong. Try again.<|im_end|>\n{OPEN}{THINK}"
            assert tokenizer.decode(env_ids) == feedback
            earlier += [{"role": "assistant", "content": reply}, *FEEDBACK]
