"""Reward actor: weighted TRL-signature rewards, the task's columns as keyword arguments, failures and
timeouts named."""

import time
from types import SimpleNamespace

import pytest
from monarch.actor import ActorError

from forge_rl.actors.reward import RewardActor, check_reward_columns, resolve_reward
from forge_rl.rewards.reward_config import RewardConfig
from forge_rl.runtime import provisioned
from tests.conftest import run


def test_weighted_rewards_columns_failures_and_timeouts():
    async def body():
        async with provisioned():
            reward = await RewardActor.as_actor([RewardConfig("exact_match", 1.0), RewardConfig("format", 0.5)])
            totals, parts = await reward.score.call_one(
                ["1+2="] * 3, ["3", "3x", "4"], ["stop", "stop", "length"], {"answer": ["3"] * 3}
            )
            assert parts == {"exact_match": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0]}
            assert totals == [1.5, 0.0, 0.0]
            # a user's reward gets every column of the row, under the column's name
            custom = await RewardActor.as_actor([RewardConfig("tests.support.actors:unit_reward")])
            _, parts = await custom.score.call_one(
                ["q", "q"], ["3 cm", "3"], ["stop", "stop"], {"answer": ["3", "3"], "unit": ["cm", "cm"]}
            )
            assert parts["tests.support.actors:unit_reward"] == [1.0, 0.0]
            with pytest.raises(ActorError, match="unit has 1 values for 2 completions"):
                await custom.score.call_one(
                    ["q", "q"], ["a", "b"], ["stop", "stop"], {"answer": ["3", "3"], "unit": ["cm"]}
                )
            for name, message in [
                ("tests.support.actors:raising_reward", "raised ZeroDivisionError"),
                ("tests.support.actors:nan_reward", "returned NaN"),
            ]:
                broken = await RewardActor.as_actor([RewardConfig("exact_match"), RewardConfig(name)])
                with pytest.raises(ActorError, match=f"reward '{name}' {message}"):
                    await broken.score.call_one(["1+2="], ["3"], ["stop"], {"answer": ["3"]})
            # a hanging verifier: the call ends at the timeout with RewardTimeout, and other groups still score
            slow = await RewardActor.as_actor([RewardConfig("tests.support.actors:slow_reward")], 0.5)
            start = time.perf_counter()
            with pytest.raises(ActorError, match="RewardTimeout.*took longer than reward_timeout_s=0.5"):
                await slow.score.call_one(["q"], ["a"], ["stop"], {})
            assert time.perf_counter() - start < 4
            # a verifier that kills its process: the actor lives on, the caller reads the reason to count
            crashing = await RewardActor.as_actor([RewardConfig("tests.support.hostile_rewards:segfaults")], 5.0, 1)
            with pytest.raises(ActorError, match="RewardCrash.*segfaults' crashed its worker") as failed:
                await crashing.score.call_one(["q"], ["a"], ["stop"], {"answer": ["a"]})
            assert failed.value.exception.reason == "reward_crash"
            assert (await crashing.stats.call_one())["replaced"] == 1

    run(body())


def test_unknown_reward_names_the_choices():
    with pytest.raises(ValueError, match=r"reward 'exact': not one of \['code_tests', 'exact_match', 'format'"):
        resolve_reward("exact")
    with pytest.raises(ValueError, match=r"reward 'code_tests': args \['wall_seconds'\] do not fit it"):
        resolve_reward("code_tests", {"wall_seconds": 3})
    assert resolve_reward("code_tests", {"wall_s": 3}).keywords == {"wall_s": 3}
    with pytest.raises(ValueError, match="cannot import no.such:thing"):
        resolve_reward("no.such:thing")


def test_a_reward_needing_a_column_the_task_lacks_is_named():
    check_reward_columns([RewardConfig("tests.support.actors:unit_reward")], ["answer", "unit"])
    with pytest.raises(ValueError, match=r"reward 'tests.support.actors:unit_reward' needs \['unit'\]"):
        check_reward_columns(
            [RewardConfig("exact_match"), RewardConfig("tests.support.actors:unit_reward")], ["answer", "id"]
        )
    with pytest.raises(ValueError, match=r"reward 'exact_match' needs \['answer'\]"):
        check_reward_columns([RewardConfig("exact_match")], ["id"])


def scripted_generator(texts: list[str]):
    """A generator that returns these completions (the reward path is under test, not generation)."""
    import torch

    from forge_rl.types import Completion

    async def route(prompt, n):
        return [
            Completion(
                torch.tensor([1]),
                torch.tensor([2, 3]),
                torch.zeros(2),
                torch.zeros(2, dtype=torch.long),
                "stop",
                text=t,
            )
            for t in texts[:n]
        ]

    return SimpleNamespace(generate=SimpleNamespace(route=route))


def test_a_reward_failing_on_its_first_groups_stops_the_run_with_its_error_and_a_sample(capsys):
    """Groups from the real rollout path (the dataset's example, the reward actor's score): a reward that raises
    on every call stops the rollout after FAIL_FAST_GROUPS groups, naming itself, its error and a sample input;
    the console shows one 'dropped group' line, not one per group. One that works once is never stopped."""
    from forge_rl.data.task import TaskConfig, to_example
    from forge_rl.loop.rollout import FAIL_FAST_GROUPS, RewardFailing, RolloutStats, rollout_from_dataset

    example = to_example({"prompt": "12+34=", "answer": "46"}, "row 0", 0, TaskConfig())

    async def example_next():
        return example

    dataset = SimpleNamespace(next=SimpleNamespace(call_one=example_next))

    async def body():
        async with provisioned():
            reward = await RewardActor.as_actor(
                [RewardConfig("exact_match"), RewardConfig("tests.support.hostile_rewards:raises")]
            )
            stats = RolloutStats()
            once = dict(
                dataset=dataset,
                generator=scripted_generator(["46", "45"]),
                reward=reward,
                buffer=None,
                group_size=2,
                stats=stats,
            )
            for _ in range(FAIL_FAST_GROUPS - 1):
                assert await rollout_from_dataset(**once) is False  # dropped and counted
            with pytest.raises(RewardFailing) as stopped:
                await rollout_from_dataset(**once)
            assert stats.drops["reward_error"] == 2 * FAIL_FAST_GROUPS
            return str(stopped.value)

    message = run(body())
    assert message.startswith(
        "reward 'tests.support.hostile_rewards:raises' failed on each of the first 8 groups it scored "
        "(reward_error), so the run stops: reward 'tests.support.hostile_rewards:raises' raised "
        "ZeroDivisionError: reward failed on purpose; a sample input: prompt="
    )
    assert "completion='46'" in message and "answer='46'" in message and "\n" not in message
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dropped group")]
    assert len(printed) == 1 and "summarised every 30 s" in printed[0]


def test_a_failing_reward_does_not_zero_another_rewards_evaluation():
    from forge_rl.data.task import TaskConfig, to_example
    from forge_rl.loop.eval import evaluate_task

    from dataclasses import replace

    examples = [
        replace(to_example({"prompt": f"{i}+0=", "answer": str(i)}, f"row {i}", i, TaskConfig()), text=f"{i}+0=")
        for i in range(4)
    ]
    answers = {e.text: e.columns["answer"] for e in examples}
    right, wrong = [e.text for e in examples[:3]], examples[3].text

    async def route(prompt, n, **sampling):  # three right answers, one wrong
        return await scripted_generator([answers[prompt] if prompt in right else "x"]).generate.route(prompt, n)

    generator = SimpleNamespace(generate=SimpleNamespace(route=route))

    async def body():
        async with provisioned():
            reward = await RewardActor.as_actor(
                [RewardConfig("exact_match"), RewardConfig("tests.support.hostile_rewards:raises")]
            )
            return (
                await evaluate_task(generator, reward, examples, "exact_match"),
                await evaluate_task(generator, reward, examples, "tests.support.hostile_rewards:raises"),
            )

    assert wrong not in right
    scored, failed = run(body())
    assert scored["accuracy"] == 0.75  # exact match's own score, whatever the other reward does
    assert failed["accuracy"] == 0.0 and failed["reward"] == 0.75  # the failed one scores 0; the total keeps the other


def test_a_dead_reward_model_stops_the_run_named_not_counted_as_drops():
    """SIGKILL a reward model's proc: scoring raises RewardRoleDied naming it (not a RewardError, so not a drop),
    and a rollout group propagates it instead of dropping the group; then the reward actor's own proc: its
    SupervisionError ends the rollout too."""
    import os
    import signal

    import psutil

    from forge_rl.actors.reward import RewardRoleDied
    from forge_rl.actors.reward_model import RewardModel
    from forge_rl.deps.monarch import SupervisionError
    from forge_rl.loop.rollout import RolloutStats, rollout_group

    async def body():
        async with provisioned():
            rm = await RewardModel.options(mesh_name="DoomedRM").as_actor("tiny-rm")
            spec = RewardConfig(model="tiny-rm")
            reward = await RewardActor.options(mesh_name="DoomedRA").as_actor([spec], 30.0, models={spec.name: rm})

            async def score(completions):
                return await reward.score.call_one(
                    ["1+2="] * len(completions), [c.text for c in completions], ["stop"] * len(completions)
                )

            stats = RolloutStats()
            assert (
                await rollout_group(
                    prompt_id="p",
                    prompt="1+2=",
                    generator=scripted_generator(["3", "4"]),
                    score=score,
                    group_size=2,
                    stats=stats,
                )
                is not None
            )
            victim = next(p for p in psutil.Process().children() if p.name() == "forge:DoomedRM")
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            start = time.perf_counter()
            with pytest.raises(
                RewardRoleDied, match="the classifier reward model 'classifier:tiny-rm' \\(tiny-rm\\) died"
            ):
                await rollout_group(
                    prompt_id="p",
                    prompt="1+2=",
                    generator=scripted_generator(["3", "4"]),
                    score=score,
                    group_size=2,
                    stats=stats,
                )
            assert time.perf_counter() - start < 25  # not the reward timeout (30 s), nor no_batch_timeout_s
            assert sum(stats.drops.values()) == 0
            # the reward actor itself killed: Monarch's SupervisionError ends the rollout (the run names the role)
            actor = next(p for p in psutil.Process().children() if p.name() == "forge:DoomedRA")  # (15 chars at most)
            os.kill(actor.pid, signal.SIGKILL)
            actor.wait(10)
            with pytest.raises(SupervisionError):
                await rollout_group(
                    prompt_id="p",
                    prompt="1+2=",
                    generator=scripted_generator(["3", "4"]),
                    score=score,
                    group_size=2,
                    stats=stats,
                )
            assert sum(stats.drops.values()) == 0

    run(body())
