"""The GRPO controller's rollout: a prompt too long for the engine is skipped and counted, other errors
end the loop. The generator's refusal is injected as the ActorError a real replica raises (the refusal
itself is tested against a real engine in test_generator.py)."""

import asyncio
from types import SimpleNamespace

import pytest
from monarch.actor import ActorError

from apps.grpo.main import GRPOConfig, rollout_once
from forge_rl.actors.generator import PromptTooLong
from forge_rl.data.arithmetic import Problem
from forge_rl.rollout import rollout_loop
from forge_rl.train_loop import Run, raise_if_failed


def endpoint(fn):
    async def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return SimpleNamespace(call_one=call, route=call)


def actors(generate):
    dataset = SimpleNamespace(next=endpoint(lambda: Problem("p0", "1+1=", "2")))
    generator = SimpleNamespace(generate=endpoint(generate))
    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **_: messages[0]["content"])
    return dataset, generator, None, None, tokenizer


def test_a_prompt_too_long_is_skipped_and_counted():
    def too_long(prompt, n):
        raise ActorError(PromptTooLong(f"prompt of 999 tokens + max_tokens=8 exceeds the engine's max_model_len"))

    run = Run(GRPOConfig(group_size=4))
    assert asyncio.run(rollout_once(run, *actors(too_long))) is False
    assert run.drops["prompt_too_long"] == 4


def test_any_other_rollout_error_ends_the_loop_and_the_run():
    def broken(prompt, n):
        raise ActorError(RuntimeError("engine request ended with unfinished completions"))

    async def body():
        run = Run(GRPOConfig(group_size=4))
        task = asyncio.create_task(rollout_loop(run.admission, run.stop, lambda: rollout_once(run, *actors(broken))))
        await asyncio.wait([task], timeout=5)
        assert task.done() and run.admission.in_flight == 0  # its admission slot was given back
        with pytest.raises(RuntimeError, match="a rollout task failed"):
            raise_if_failed([task])

    asyncio.run(body())
