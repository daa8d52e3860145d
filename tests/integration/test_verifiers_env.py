"""agent.verifiers (forge_rl/agents/verifiers_env.py) against the real verifiers package: the
example taskset (examples/verifiers_addition) becomes the task's rows and held-out rows, a config's own task is
kept, and each mistake (an unknown taskset, a module with no taskset, a taskset whose loading raises, a builder
function that raises or returns something else, no verifiers installed, entry and verifiers both set) is one line
naming the key and what to do, before any engine starts. It starts no process, but it is not a unit test: importing
verifiers' environments (and the anthropic and openai clients they import) alone takes seconds, so it runs with the
integration tests, beside the shipped verifiers configs' start-up check (tests/support/shipped_configs.py)."""

import copy
import json
import sys
from functools import cache

import pytest

from forge_rl.agents.config import AgentConfig, VerifiersConfig
from forge_rl.agents.server import episode_model, episode_of_model
from forge_rl.agents.verifiers_env import TASK_COLUMN, load_environment, verifiers_task
from forge_rl.config import ConfigError, load_config
from forge_rl.data.task import TaskConfig
from forge_rl.recipes.grpo_checks import check_agent
from forge_rl.recipes.grpo_config import GRPOConfig
from tests.conftest import REPO
from tests.support.shipped_configs import SHIPPED, check_shipped_config, needs

EXAMPLE = "examples.verifiers_addition"


def raises_on_build(**kwargs):
    raise RuntimeError("the dataset is not there")


def builds_no_env(**kwargs):
    return {"not": "an env"}


@cache
def _demo() -> GRPOConfig:
    return load_config(GRPOConfig, REPO / "configs/grpo/tiny_verifiers.yaml", ["agent.verifiers.args.size=40"])


def _refused(**verifiers) -> str:
    cfg = copy.deepcopy(_demo())
    for key, value in verifiers.items():
        setattr(cfg.agent.verifiers, key, value)
    with pytest.raises(ConfigError) as e:
        check_agent(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("path", [p for p in SHIPPED if needs("verifiers", p)], ids=lambda p: p.name)
def test_the_shipped_verifiers_configs_load_and_validate(path):
    check_shipped_config(path)


def test_the_tasksets_rows_become_the_task_and_its_test_split_the_held_out_set():
    cfg = copy.deepcopy(_demo())
    check_agent(cfg)
    task = verifiers_task(cfg.task, cfg.agent.verifiers)
    train, held_out = _rows(task.source), _rows(task.held_out)
    assert (len(train), len(held_out)) == (40, 200)
    assert (task.prompt_column, task.answer_column, task.id_column) == ("prompt", "answer", "id")
    first = train[0]
    assert first["prompt"] == [{"role": "user", "content": first[TASK_COLUMN]["prompt"]}]
    a, b = first[TASK_COLUMN]["prompt"].rstrip("=").split("+")
    assert first["answer"] == str(int(a) + int(b)) == first[TASK_COLUMN]["answer"]
    questions = {r[TASK_COLUMN]["prompt"] for r in train}
    assert not questions & {r[TASK_COLUMN]["prompt"] for r in held_out}  # never trained on a held-out question


def test_a_task_given_in_the_config_is_kept():
    own = TaskConfig(source="tests/data/own.jsonl")
    assert verifiers_task(own, VerifiersConfig(env=EXAMPLE)) is own


def test_the_environment_is_verifiers_own_with_its_reward_functions():
    env = load_environment(VerifiersConfig(env=EXAMPLE, args={"size": 3}))
    task_type = type(env.taskset).task_type()
    assert [fn.__name__ for fn in task_type(next(iter(env.taskset)).data).hooks("reward")] == ["correct"]


@pytest.mark.parametrize(
    "settings, names",
    [
        (dict(env="no_such_taskset_anywhere"), ["agent.verifiers.env='no_such_taskset_anywhere'", "not found"]),
        (dict(env="examples.no_such_module"), ["agent.verifiers.env='examples.no_such_module'", "cannot import"]),
        (dict(env="examples.agents.retry_agent"), ["agent.verifiers.env='examples.agents.retry_agent'", "__all__"]),
        (dict(args={"split": "validation"}), ["agent.verifiers.args", "could not load", "taskset.split"]),
        (dict(env=f"{__name__}:raises_on_build"), ["agent.verifiers.env", "raised RuntimeError", "not there"]),
        (dict(env=f"{__name__}:builds_no_env"), ["agent.verifiers.env", "returned a dict", "verifiers.v1 Env"]),
        (dict(harness="examples.no_harness"), ["agent.verifiers.harness='examples.no_harness'", "cannot import"]),
    ],
)
def test_a_bad_verifiers_setting_is_one_line_naming_it(settings, names):
    line = _refused(**settings)
    assert all(name in line for name in names), line


def test_without_the_verifiers_package_the_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # the extra not installed: the import fails
    line = _refused(env="another_taskset")
    assert "agent.verifiers.env" in line and "forge_rl[agents]" in line


@pytest.mark.parametrize(
    "settings, names",
    [
        (dict(entry="examples.agents.retry_agent:solve", verifiers={"env": EXAMPLE}), ["agent.entry", "one of them"]),
        (dict(verifiers={"env": ""}), ["agent.verifiers.env=''"]),
        (dict(verifiers={"env": EXAMPLE, "args": [1]}), ["agent.verifiers.args=[1]", "mapping"]),
    ],
)
def test_a_bad_verifiers_value_is_refused_when_read(settings, names):
    with pytest.raises(ValueError) as e:
        AgentConfig(**settings)
    assert all(name in str(e.value) for name in names), str(e.value)


def test_a_shared_client_names_its_episode_in_the_model():
    """verifiers' interception server keeps one client per endpoint URL: episodes share the root URL and are named
    in the model, which the endpoint routes by."""
    root, model = episode_model("http://127.0.0.1:4321/episodes/t12/v1/", "tiny-warm")
    assert (root, model) == ("http://127.0.0.1:4321/v1", "tiny-warm@episode/t12")
    assert episode_of_model(model) == "t12" and episode_of_model("tiny-warm") is None
    with pytest.raises(ValueError):
        episode_model("http://127.0.0.1:4321/v1", "tiny-warm")


@pytest.mark.parametrize("args, says", [({"max_operand": -1}, "raised ValueError"), ({"size": 0}, "yields no task")])
def test_a_taskset_that_raises_or_yields_nothing_is_one_line(args, says):
    with pytest.raises(ConfigError) as e:
        verifiers_task(TaskConfig(), VerifiersConfig(env=EXAMPLE, args=args))
    assert "agent.verifiers.env" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)
