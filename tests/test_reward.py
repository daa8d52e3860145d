"""Reward actor: weighted TRL-signature rewards, per-function values, and failures named."""

import pytest
from monarch.actor import ActorError

from forge_rl.actors.reward import RewardActor, RewardSpec, resolve_reward
from forge_rl.controller import provisioned
from tests.conftest import run


def test_weighted_rewards_and_failures_named():
    async def body():
        async with provisioned():
            reward = await RewardActor.as_actor([RewardSpec("exact_match", 1.0), RewardSpec("format", 0.5)])
            totals, parts = await reward.score.call_one("1+2=", ["3", "3x", "4"], "3", ["stop", "stop", "length"])
            assert parts == {"exact_match": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0]}
            assert totals == [1.5, 0.0, 0.0]
            for name, message in [("tests.actors:raising_reward", "raised ZeroDivisionError"),
                                  ("tests.actors:nan_reward", "returned NaN")]:
                broken = await RewardActor.as_actor([RewardSpec("exact_match"), RewardSpec(name)])
                with pytest.raises(ActorError, match=f"reward '{name}' {message}"):
                    await broken.score.call_one("1+2=", ["3"], "3", ["stop"])

    run(body())


def test_unknown_reward_names_the_choices():
    with pytest.raises(ValueError, match=r"reward 'exact': not one of \['exact_match', 'format'\]"):
        resolve_reward("exact")
    with pytest.raises(ValueError, match="cannot import no.such:thing"):
        resolve_reward("no.such:thing")
