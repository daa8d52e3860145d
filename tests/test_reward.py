"""Reward actor: weighted TRL-signature rewards, the task's columns as keyword arguments, failures and
timeouts named."""

import time

import pytest
from monarch.actor import ActorError

from forge_rl.actors.reward import RewardActor, RewardSpec, check_reward_columns, resolve_reward
from forge_rl.runtime import provisioned
from tests.conftest import run


def test_weighted_rewards_columns_failures_and_timeouts():
    async def body():
        async with provisioned():
            reward = await RewardActor.as_actor([RewardSpec("exact_match", 1.0), RewardSpec("format", 0.5)])
            totals, parts = await reward.score.call_one(["1+2="] * 3, ["3", "3x", "4"], ["stop", "stop", "length"],
                                                        {"answer": ["3"] * 3})
            assert parts == {"exact_match": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0]}
            assert totals == [1.5, 0.0, 0.0]
            # a user's reward gets every column of the row, under the column's name
            custom = await RewardActor.as_actor([RewardSpec("tests.actors:unit_reward")])
            _, parts = await custom.score.call_one(["q", "q"], ["3 cm", "3"], ["stop", "stop"],
                                                   {"answer": ["3", "3"], "unit": ["cm", "cm"]})
            assert parts["tests.actors:unit_reward"] == [1.0, 0.0]
            with pytest.raises(ActorError, match="unit has 1 values for 2 completions"):
                await custom.score.call_one(["q", "q"], ["a", "b"], ["stop", "stop"], {"answer": ["3", "3"], "unit": ["cm"]})
            for name, message in [("tests.actors:raising_reward", "raised ZeroDivisionError"),
                                  ("tests.actors:nan_reward", "returned NaN")]:
                broken = await RewardActor.as_actor([RewardSpec("exact_match"), RewardSpec(name)])
                with pytest.raises(ActorError, match=f"reward '{name}' {message}"):
                    await broken.score.call_one(["1+2="], ["3"], ["stop"], {"answer": ["3"]})
            # a hanging verifier: the call ends at the timeout with RewardTimeout, and other groups still score
            slow = await RewardActor.as_actor([RewardSpec("tests.actors:slow_reward")], 0.5)
            start = time.perf_counter()
            with pytest.raises(ActorError, match="RewardTimeout.*took longer than reward_timeout_s=0.5"):
                await slow.score.call_one(["q"], ["a"], ["stop"], {})
            assert time.perf_counter() - start < 4
            # a verifier that kills its process: the actor lives on, the caller reads the reason to count
            crashing = await RewardActor.as_actor([RewardSpec("tests.hostile_rewards:segfaults")], 5.0, 1)
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
    check_reward_columns([RewardSpec("tests.actors:unit_reward")], ["answer", "unit"])
    with pytest.raises(ValueError, match=r"reward 'tests.actors:unit_reward' needs \['unit'\]"):
        check_reward_columns([RewardSpec("exact_match"), RewardSpec("tests.actors:unit_reward")], ["answer", "id"])
    with pytest.raises(ValueError, match=r"reward 'exact_match' needs \['answer'\]"):
        check_reward_columns([RewardSpec("exact_match")], ["id"])
