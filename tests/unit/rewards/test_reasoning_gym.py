"""A reasoning-gym task's reward: the task's own scorer (the real package), full credit or none unless partial
credit is asked for, and the default reward of a reasoning-gym source."""

from forge_rl.config import load_config
from forge_rl.data.reasoning_gym import ReasoningGymConfig
from forge_rl.data.task import TaskConfig, TaskRows
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.rewards.reasoning_gym import SCORER, score_answer, task_rewards

SUMS = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=["+"], allow_parentheses=False)


def scored(examples, completions, **args) -> list[float]:
    columns = {k: [e.columns[k] for e in examples] for k in ("entry", "dataset")}
    return score_answer([e.prompt for e in examples], completions, **columns, **args)


def test_padding_an_answer_earns_nothing_unless_partial_credit_is_asked_for():
    rg = ReasoningGymConfig(config=SUMS, held_out_size=4, train_size=1)
    held = TaskRows(TaskConfig(source="reasoning_gym:basic_arithmetic", reasoning_gym=rg)).held_out()
    oracle = [e.answer for e in held]
    completions = [oracle[0], f"x{oracle[1]}", f" <answer>{oracle[2]}</answer>\n", "7" + oracle[3]]
    # basic_arithmetic's scorer pays len(oracle) / len(answer) to an answer that contains the oracle
    partial = scored(held, completions, partial_credit=True)
    assert partial[0] == partial[2] == 1.0 and 0 < partial[1] < 1 and 0 < partial[3] < 1
    assert scored(held, completions) == [1.0, 0.0, 1.0, 0.0]
    assert scored(held, [f"<answer>{oracle[0]}</answer>"] * 4, answer_tag=None)[0] == 0.0  # the tag, taken whole


def test_a_composite_item_is_scored_by_the_task_that_made_it():
    datasets = [{"name": "basic_arithmetic", "weight": 1, "config": SUMS}, {"name": "spell_backward", "weight": 1}]
    rg = ReasoningGymConfig(config={"datasets": datasets}, held_out_size=40, train_size=1)
    held = TaskRows(TaskConfig(source="reasoning_gym:composite", reasoning_gym=rg)).held_out()
    assert scored(held, [e.answer for e in held]) == [1.0] * len(held)
    # spell_backward's own scorer gives prefix credit, cut to nothing by default
    words = [e for e in held if e.columns["entry"]["metadata"]["source_dataset"] == "spell_backward"]
    assert scored(words, [e.answer[:-1] for e in words]) == [0.0] * len(words)
    assert all(0 < s < 1 for s in scored(words, [e.answer[:-1] for e in words], partial_credit=True))


def test_the_scorer_is_the_default_reward_of_a_reasoning_gym_source_and_can_be_replaced(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("task: {source: 'reasoning_gym:basic_arithmetic'}\n")
    assert [r.name for r in task_rewards(load_config(GRPOConfig, config))] == [SCORER]
    assert [r.name for r in task_rewards(load_config(GRPOConfig))] == ["exact_match", "format"]  # other sources
    config.write_text(
        "task: {source: 'reasoning_gym:basic_arithmetic'}\n"
        f"rewards: [{{name: '{SCORER}', args: {{partial_credit: true}}}}, {{name: exact_match, weight: 0.5}}]\n"
    )
    given = task_rewards(load_config(GRPOConfig, config))
    assert [(r.name, r.args) for r in given] == [(SCORER, {"partial_credit": True}), ("exact_match", {})]
