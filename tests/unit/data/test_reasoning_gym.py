"""reasoning-gym tasks as a task source (`task.source: reasoning_gym:NAME`), against the real reasoning-gym package:
splits of one seed that share no question, duplicates removed, the prompt format, composites, and every bad input
ending in one line that names it. Small sizes: the whole file runs in a few seconds (most of it importing the
package)."""

import re
import sys

import pytest
import reasoning_gym

from forge_rl.config import ConfigError, load_config
from forge_rl.data.reasoning_gym import ReasoningGymConfig, equation_prompt
from forge_rl.data.sources import DataError, read_rows
from forge_rl.data.task import TaskConfig, TaskRows

# 2-term additions of 1-digit operands (0-10): 121 distinct questions, so the generator repeats itself early
SMALL_SUMS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"], allow_parentheses=False)
EQUATION = "forge_rl.data.reasoning_gym:equation_prompt"


def task(config=SMALL_SUMS, name="basic_arithmetic", held_out=20, train=60, template="{question}", **kw):
    rg = ReasoningGymConfig(config=config, prompt_template=template, held_out_size=held_out, train_size=train)
    return TaskConfig(source=f"reasoning_gym:{name}", reasoning_gym=rg, **kw)


def questions(examples) -> list[str]:
    return [e.columns["entry"]["question"] for e in examples]


def test_the_generator_leaks_across_seeds_so_splits_are_index_ranges_of_one_seed():
    # the premise: item k of seed s+1 is item k+1 of seed s, so a held-out seed would be a training seed shifted
    a = reasoning_gym.create_dataset("basic_arithmetic", seed=7, size=10, **SMALL_SUMS)
    b = reasoning_gym.create_dataset("basic_arithmetic", seed=8, size=10, **SMALL_SUMS)
    assert [a[k + 1]["question"] for k in range(5)] == [b[k]["question"] for k in range(5)]

    rows = TaskRows(task(), seed=0)
    held, train = rows.held_out(), rows.examples
    assert (len(held), len(train)) == (20, 60)
    assert not set(questions(held)) & set(questions(train))
    assert not {e.prompt for e in held} & {e.prompt for e in train}
    # index ranges: the held-out set is taken first, training after it
    held_index = [e.columns["entry"]["metadata"]["source_index"] for e in held]
    train_index = [e.columns["entry"]["metadata"]["source_index"] for e in train]
    assert held_index[0] == 0 and held_index == sorted(held_index) and max(held_index) < min(train_index)
    # deterministic, and the same for every run seed (task.split_seed decides); the run's seed only orders training
    other = TaskRows(task(), seed=3)
    assert questions(other.held_out()) == questions(held) and questions(other.examples) == questions(train)
    assert [rows.next().prompt for _ in range(60)] != [other.next().prompt for _ in range(60)]
    moved = TaskRows(task(split_seed=1))
    assert questions(moved.held_out()) != questions(held)


def test_duplicate_questions_are_removed():
    raw = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=100, **SMALL_SUMS)
    first = [raw[i]["question"] for i in range(100)]
    assert len(set(first)) < len(first)  # the generator does repeat itself in these indices

    rows = TaskRows(task(held_out=20, train=80))
    all_questions = questions(rows.held_out()) + questions(rows.examples)
    assert len(all_questions) == len(set(all_questions)) == 100

    # a task with fewer distinct questions than asked for says so and what to change
    with pytest.raises(DataError) as e:
        TaskRows(task(held_out=20, train=200))
    assert "only 121 distinct questions" in str(e.value) and "task.reasoning_gym.train_size" in str(e.value)


def test_prompt_format_equation_for_the_tiny_models_and_format_strings():
    rows = TaskRows(task(template=EQUATION, held_out=5, train=30))
    for e in rows.held_out() + rows.examples:
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", e.prompt).groups()
        assert e.answer == str(int(a) + int(b)) and e.messages == [{"role": "user", "content": e.prompt}]
    # a format string of the item's fields: the question and each metadata key
    rows = TaskRows(task(template="Q: {question} ({num_terms} terms) {metadata[expression]}", held_out=1, train=1))
    entry = rows.held_out()[0].columns["entry"]
    assert rows.held_out()[0].prompt == f"Q: {entry['question']} (2 terms) {entry['metadata']['expression']}"
    # a prompt that would give the answer away, a field the item does not have, a template function that fails
    with pytest.raises(DataError, match=r"may not show the answer"):
        TaskRows(task(template="{question} = {answer}"))
    with pytest.raises(DataError, match=r"the item has no field 'expresion'; its fields: \[.*'expression'"):
        TaskRows(task(template="{expresion}="))
    with pytest.raises(DataError, match=r"has no metadata 'expression'"):
        equation_prompt({"question": "Spell 'cat' backwards", "metadata": {"word": "cat"}})


def test_composite_of_weighted_tasks():
    datasets = [
        {"name": "basic_arithmetic", "weight": 3, "config": SMALL_SUMS},
        {"name": "spell_backward", "weight": 1},
    ]
    rows = TaskRows(task(config={"datasets": datasets}, name="composite", held_out=30, train=170))
    examples = rows.held_out() + rows.examples
    made_by = [e.columns["entry"]["metadata"]["source_dataset"] for e in examples]
    assert set(made_by) == {"basic_arithmetic", "spell_backward"}
    assert made_by.count("basic_arithmetic") > made_by.count("spell_backward")  # weights 3:1
    # each row names the task that made it, for its scorer
    assert all(f'"name": "{m}"' in e.columns["dataset"] for e, m in zip(examples, made_by, strict=True))
    assert not set(questions(rows.held_out())) & set(questions(rows.examples))


def one_line_error(error_type, make) -> str:
    with pytest.raises(error_type) as e:
        make()
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_inputs_end_in_one_line_naming_them(tmp_path, monkeypatch):
    message = one_line_error(DataError, lambda: TaskRows(task(name="basic_arithmetc")))
    assert "reasoning_gym:basic_arithmetc" in message and "did you mean 'basic_arithmetic'" in message
    message = one_line_error(DataError, lambda: TaskRows(task(config={**SMALL_SUMS, "max_term": 3})))
    assert "task.reasoning_gym.config.max_term" in message and "did you mean 'max_terms'" in message
    assert "'allow_parentheses'" in message and "'format_style'" in message  # the task's valid keys, listed
    message = one_line_error(DataError, lambda: TaskRows(task(config={"seed": 3})))
    assert "task.reasoning_gym.config.seed" in message and "task.split_seed" in message
    message = one_line_error(DataError, lambda: TaskRows(task(config={"min_terms": 3, "max_terms": 2})))
    assert "basic_arithmetic refuses it" in message and "max_terms must be >= min_terms" in message
    bad_spec = {"datasets": [{"name": "chain_sum", "config": {"max_termz": 3}}]}
    message = one_line_error(DataError, lambda: TaskRows(task(config=bad_spec, name="composite")))
    assert "task.reasoning_gym.config.datasets[0].config.max_termz" in message and "'max_terms'" in message
    message = one_line_error(
        DataError, lambda: TaskRows(task(config={"datasets": [{"name": "chainsum"}]}, name="composite"))
    )
    assert "datasets[0].name=chainsum" in message and "'chain_sum'" in message
    message = one_line_error(DataError, lambda: read_rows("reasoning_gym:basic_arithmetic"))
    assert "task.source" in message

    # the settings of file sources do not apply: named when the config is read
    config = tmp_path / "c.yaml"
    config.write_text("source: reasoning_gym:basic_arithmetic\nheld_out: data/test.jsonl\n")
    message = one_line_error(ConfigError, lambda: load_config(TaskConfig, config))
    assert "task.held_out='data/test.jsonl'" in message and "held_out_size" in message

    # the optional extra not installed (a fault injected: the package cannot be imported)
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    message = one_line_error(DataError, lambda: TaskRows(task()))
    assert message == (
        "task.source reasoning_gym:basic_arithmetic: needs the optional extra: pip install 'forge_rl[envs]'"
    )
