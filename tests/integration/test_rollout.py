"""A task's rollout (`rollout_from_dataset`): a prompt too long for the engine is skipped and counted, other
errors end the loop. The generator's refusal is injected as the ActorError a real replica raises (the refusal
itself is tested against a real engine in test_generator.py)."""

import asyncio
from types import SimpleNamespace

import pytest
from monarch.actor import ActorError

from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.actors.generator import PromptTooLong
from forge_rl.data.task import TaskConfig, to_example
from forge_rl.loop.rollout import rollout_from_dataset, rollout_loop
from forge_rl.loop.train_loop import RunState, raise_if_failed


def endpoint(fn):
    async def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return SimpleNamespace(call_one=call, route=call)


def rollout_once(run, generate):
    example = to_example({"prompt": "1+1=", "answer": "2"}, "row 0", 0, TaskConfig())
    dataset = SimpleNamespace(next=endpoint(lambda: example))
    generator = SimpleNamespace(generate=endpoint(generate))
    return rollout_from_dataset(
        dataset=dataset,
        generator=generator,
        reward=None,
        buffer=None,
        group_size=run.cfg.group_size,
        stats=run.rollouts,
    )


def test_a_prompt_too_long_is_skipped_and_counted():
    def too_long(prompt, n):
        raise ActorError(PromptTooLong("prompt of 999 tokens + max_tokens=8 exceeds the engine's max_model_len"))

    run = RunState(GRPOConfig(group_size=4))
    assert asyncio.run(rollout_once(run, too_long)) is False
    assert run.drops["prompt_too_long"] == 1  # prompts, not episodes: none was generated


def test_any_other_rollout_error_ends_the_loop_and_the_run():
    def broken(prompt, n):
        raise ActorError(RuntimeError("engine request ended with unfinished completions"))

    async def body():
        run = RunState(GRPOConfig(group_size=4))
        task = asyncio.create_task(rollout_loop(run.admission, run.stop, lambda: rollout_once(run, broken)))
        await asyncio.wait([task], timeout=5)
        assert task.done() and run.admission.in_flight == 0  # its admission slot was given back
        with pytest.raises(RuntimeError, match="a rollout task failed"):
            raise_if_failed([task])

    asyncio.run(body())


def test_overlong_completions_are_penalised_and_filtered_before_advantages():
    """DAPO's overlong shaping in a group: the generator is scripted (lengths 2, 6, 8 tokens of max 8), the
    shaping is what is tested."""
    import torch

    from forge_rl.rewards.overlong import OverlongConfig, overlong_penalty
    from forge_rl.loop.rollout import RolloutStats, rollout_group
    from forge_rl.types import Completion

    assert [overlong_penalty(n, 8, 4) for n in (4, 5, 6, 8, 9)] == [0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(8, 8, 0) == 0.0

    def completion(n, finish):
        return Completion(
            torch.tensor([1, 2]),
            torch.arange(3, 3 + n),
            torch.full((n,), -0.5),
            torch.zeros(n, dtype=torch.long),
            finish,
        )

    completions = [completion(2, "stop"), completion(6, "stop"), completion(8, "length")]
    generator = SimpleNamespace(generate=endpoint(lambda prompt, n: completions))

    async def score(cs):
        return [1.0, 1.0, 1.0], {"exact_match": [1.0, 1.0, 1.0]}

    stats = RolloutStats()
    group = asyncio.run(
        rollout_group(
            prompt_id="p",
            prompt="1+1=",
            generator=generator,
            score=score,
            group_size=3,
            stats=stats,
            overlong=OverlongConfig(penalty_cache_len=4, filter=True),
            max_tokens=8,
        )
    )
    assert stats.parts["overlong"] == [0.0, -0.5, -1.0] and stats.rewards == [1.0, 0.5, 0.0]
    advantages = [e.advantage for e in group.episodes]
    assert advantages[0] > 0 and abs(advantages[1]) < 1e-6  # rewards 1, 0.5, 0: the group's mean is 0.5
    assert advantages[2] == 0.0  # truncated: filtered out of the loss
