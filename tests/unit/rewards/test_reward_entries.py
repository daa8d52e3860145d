"""A `rewards:` entry's mistakes are named by its path in the list (`rewards[1].name`, `rewards[0].kind`): the
checks that loop over the run's rewards know the index, a RewardConfig on its own does not."""

import pytest

from forge_rl.actors.reward import check_reward_columns, reward_model_errors
from forge_rl.rewards.reward_config import RewardConfig

FUNCTIONS = "['code_tests', 'exact_match', 'format', 'math', 'math_format']"


def test_a_reward_models_unknown_kind_is_named_by_the_check_of_its_settings():
    """check_config prefixes each of these with rewards[i]. (`rewards[0].kind='abc': ...`)."""
    spec = RewardConfig(model="tiny-rm", kind="abc")  # the entry alone cannot say which it is
    assert reward_model_errors(spec) == [
        "kind='abc': the reward model 'tiny-rm' has no such kind; choose one of ('classifier', 'judge')"
    ]
    assert reward_model_errors(RewardConfig(model="tiny-rm")) == []


@pytest.mark.parametrize(
    "specs, message",
    [
        (
            [RewardConfig("format"), RewardConfig("abc")],
            f"rewards[1].name: reward 'abc': not one of {FUNCTIONS} and not 'package.module:function'",
        ),
        (
            [RewardConfig("no_such_module:score")],
            "rewards[0].name: reward 'no_such_module:score': cannot import no_such_module:score "
            "(No module named 'no_such_module')",
        ),
        (
            [RewardConfig(model="tiny-rm"), RewardConfig("format", args={"x": 1})],
            "rewards[1].args: reward 'format': args ['x'] do not fit it (its parameters: ['completions', "
            "'finish_reason', 'prompts'])",
        ),
        (
            [RewardConfig("format"), RewardConfig("exact_match")],
            "rewards[1]: reward 'exact_match' needs ['answer'], which the task's rows do not have (columns: "
            "['finish_reason', 'id']); map them with task.answer_column or add them to the data",
        ),
    ],
)
def test_a_reward_functions_mistake_names_its_entry(specs, message):
    with pytest.raises(ValueError) as raised:
        check_reward_columns(specs, ["id"])
    assert str(raised.value) == message
