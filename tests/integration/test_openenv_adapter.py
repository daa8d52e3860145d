"""env.openenv in process, against the real openenv package: a group's trajectories start on one task, each step's
reward reaches the episode, MCP tools reach the chat template and their calls the environment, and every bad input
ends in one line (a dropped group, a refused config, a stopped run). The model's replies are scripted (the
generator is not under test here); the served and whole-run paths are tests/integration/test_openenv.py's. It starts
no process, but importing openenv costs seconds (gradio, fastmcp), so it is not among make test-fast's unit tests."""

import asyncio
import sys

import pytest
import torch
from transformers import AutoTokenizer

from forge_rl.data.task import TaskExample
from forge_rl.envs import EnvConfig, env_factory
from forge_rl.envs.openenv import example_seed
from forge_rl.envs.openenv_config import EXTRA_MISSING, OpenEnvConfig
from forge_rl.errors import ConfigError
from forge_rl.loop.multiturn import EnvFailing, evaluate_env, rollout_env_group
from forge_rl.loop.turn_renderer import TurnRenderer
from forge_rl.loop.rollout import FAIL_FAST_GROUPS, RolloutStats
from forge_rl.models import TINY_MODEL_DIR
from forge_rl.types import Completion
from tests.support.openenv_envs import RecordedAddition
from tests.support.shipped_configs import SHIPPED, check_shipped_config, needs

ENVS = "tests.support.openenv_envs"


def example(i: str = "t0", question: str = "12+34=") -> TaskExample:
    return TaskExample(i, question, [{"role": "user", "content": question}], None, {"question": question}, "row")


def openenv(env: str = "RecordedAddition", max_total_tokens: int = 64, **section) -> EnvConfig:
    section = {"action_field": "answer", "observation_field": "message", **section}
    return EnvConfig(
        openenv=OpenEnvConfig(env=f"{ENVS}:{env}", **section), max_turns=2, max_total_tokens=max_total_tokens
    )


class ScriptedReplies:
    """The generator's `generate.route`, replying with `replies` in turn (the first turn of every trajectory the
    first reply, and so on): what the model says is not what these tests are about. Records each prompt."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.prompts = tokenizer, replies, []
        self.generate = self
        self.route = self._route

    async def _route(self, prompt_ids, n=1, **_):
        self.prompts.append(list(prompt_ids))
        turn = self.tokenizer.decode(prompt_ids).count("<|im_start|>assistant")  # the model's turns, this one too
        text = self.replies[min(turn, len(self.replies)) - 1]
        ids = self.tokenizer(f"{text}<|im_end|>", add_special_tokens=False)["input_ids"]
        response = (torch.tensor(ids), torch.zeros(len(ids)), torch.zeros(len(ids), dtype=torch.long))
        return [Completion(torch.tensor(prompt_ids), *response, "stop", text=text) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


def play(
    tokenizer, cfg: EnvConfig, replies: list[str], ex: TaskExample | None = None, group_size: int = 4, factory=None
):
    stats = RolloutStats()
    generator = ScriptedReplies(tokenizer, replies)
    factory = factory or env_factory(cfg, type("Run", (), {"seed": 7})())
    group = asyncio.run(
        rollout_env_group(
            ex or example(), [1, 2, 3], generator, factory, TurnRenderer(tokenizer), cfg, group_size, 8, stats
        )
    )
    return group, stats, generator


@pytest.mark.parametrize("path", [p for p in SHIPPED if needs("openenv", p)], ids=lambda p: p.name)
def test_the_shipped_openenv_configs_load_and_validate(path):
    check_shipped_config(path)


def test_a_groups_trajectories_start_on_one_task_posed_by_the_first_observation(tokenizer):
    RecordedAddition.resets.clear()
    closed = RecordedAddition.closed
    cfg = openenv()  # no reset_columns: the environment draws its question from the seed
    group, _, generator = play(tokenizer, cfg, ["0", "0"], group_size=4)
    seeds = {seed for seed, _ in RecordedAddition.resets}
    assert len(RecordedAddition.resets) == 4 and seeds == {example_seed(7, "t0")}
    assert RecordedAddition.closed == closed + 4  # every episode closed
    prompt = tokenizer.decode(group.episodes[0].completion.prompt_ids)
    assert "12+34=" not in prompt and "+" in prompt  # the environment's question, not the row's
    assert all(torch.equal(e.completion.prompt_ids, group.episodes[0].completion.prompt_ids) for e in group.episodes)
    other, _, _ = play(tokenizer, cfg, ["0"], ex=example("t1"), group_size=2)
    assert tokenizer.decode(other.episodes[0].completion.prompt_ids) != prompt  # another example, another task


def test_each_steps_reward_reaches_the_episode_and_the_return_is_their_sum(tokenizer):
    RecordedAddition.resets.clear()
    cfg = openenv(reset_columns={"question": "question"})
    group, stats, _ = play(tokenizer, cfg, ["45", "46"], group_size=2)
    assert RecordedAddition.resets == [(example_seed(7, "t0"), "12+34=")] * 2  # the row's question reached reset
    for episode in group.episodes:
        assert episode.metadata["step_rewards"] == [0.0, 0.5]  # wrong, then right on the retry
        assert episode.reward == 0.5 and episode.rewards["solved"] == 1.0 and episode.metadata["turns"] == 2
        assert "Wrong. Try again." in tokenizer.decode(episode.completion.response_ids)


def test_mcp_tools_reach_the_chat_template_and_a_tool_call_the_environment(tokenizer):
    cfg = openenv("CalculatorEnv", 512, action=f"{ENVS}:AnswerAction", observation_field=None)  # a char tokenizer
    factory = env_factory(cfg, type("Run", (), {"seed": 0})())
    (tool,) = factory.template_kwargs["tools"]
    assert tool["function"]["name"] == "add" and tool["function"]["parameters"]["required"] == ["a", "b"]
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1234, "b": 4321}}\n</tool_call>'
    group, _, _ = play(tokenizer, cfg, [call, "5555"], group_size=1, factory=factory)
    (episode,) = group.episodes
    assert episode.metadata["step_rewards"] == [0.0, 1.0]
    assert "5555" in tokenizer.decode(episode.completion.response_ids[episode.completion.env_mask])  # the result


@pytest.mark.parametrize(
    "env, reason, says",
    [
        ("RaisesInReset", "env_error", "the reset's own bug"),
        ("RaisesInStep", "env_error", "the step's own bug"),
        ("HangsInStep", "env_timeout", "step took longer than env.openenv.step_timeout_s=0.5 s"),
        ("NaNReward", "env_error", "the reward is nan"),
        ("TextReward", "env_error", "the reward 'high' (str) is not a number"),
    ],
)
def test_an_environment_that_breaks_drops_its_group_in_one_line(tokenizer, capsys, env, reason, says):
    group, stats, _ = play(tokenizer, openenv(env, step_timeout_s=0.5), ["46"], group_size=2)
    assert group is None and stats.drops[reason] == 2
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(printed) == 1 and f"({reason})" in printed[0] and says in printed[0], printed


def test_a_reply_the_action_refuses_ends_its_trajectory_with_reward_0_said_once(tokenizer, capsys):
    cfg = openenv("NumberAddition", action_field="number", reset_columns={"question": "question"})
    group, stats, _ = play(tokenizer, cfg, ["forty-six"], group_size=3)
    assert [e.metadata["step_rewards"] for e in group.episodes] == [[0.0]] * 3 and not any(stats.drops.values())
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and "NumberAction refused" in printed[0] and "reward 0" in printed[0]
    right, _, _ = play(tokenizer, cfg, ["46"], group_size=1)
    assert right.episodes[0].reward == 1.0  # a number it takes


def test_an_environment_failing_group_after_group_stops_the_run_in_one_line(tokenizer, capsys):
    cfg = openenv("RaisesInStep")
    factory = env_factory(cfg, type("Run", (), {"seed": 0})())
    for _ in range(FAIL_FAST_GROUPS - 1):
        assert play(tokenizer, cfg, ["46"], group_size=1, factory=factory)[0] is None
    with pytest.raises(EnvFailing, match=f"failed on {FAIL_FAST_GROUPS} groups in a row.*the step's own bug"):
        play(tokenizer, cfg, ["46"], group_size=1, factory=factory)


def test_evaluation_counts_the_solved_with_the_examples_own_seed(tokenizer):
    cfg = openenv(reset_columns={"question": "question"})
    examples = [example("a", "12+34="), example("b", "1+1=")]
    result = asyncio.run(
        evaluate_env(ScriptedReplies(tokenizer, ["46"]), examples, env_factory(cfg), TurnRenderer(tokenizer), cfg, 8)
    )
    assert result["accuracy"] == 0.5 and result["first_turn"] == 0.5 and result["n"] == 2


@pytest.mark.parametrize(
    "section, says",
    [
        (dict(env=f"{ENVS}:NotAnEnvironment"), "is not an OpenEnv Environment"),
        (dict(env=f"{ENVS}:Nowhere"), "cannot import it"),
        (dict(env=f"{ENVS}:RecordedAddition", action_field="reply"), "env.openenv.action_field='reply'"),
        (dict(env=f"{ENVS}:RecordedAddition", reset_args={"level": 3}), "['level'], which RecordedAddition.reset"),
        (dict(env=f"{ENVS}:RecordedAddition", observation_field="text"), "observation_field='text'"),
    ],
)
def test_a_config_that_does_not_fit_the_environment_is_one_line_naming_the_key(section, says):
    with pytest.raises(ConfigError, match=None) as e:
        env_factory(EnvConfig(openenv=OpenEnvConfig(**section)))
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "section, says",
    [
        (dict(), "give one of env.openenv.env"),
        (dict(env="a:B", url="http://x:1"), "give one of env.openenv.env"),
        (dict(url="http://x:1", serve=True), "apply to env.openenv.env"),
        (dict(env="a.B"), "write it 'package.module:Class'"),
        (dict(env="a:B", max_concurrency=4), "needs serve: true"),
    ],
)
def test_a_section_that_contradicts_itself_is_refused_when_read(section, says):
    with pytest.raises(ValueError, match=None) as e:
        OpenEnvConfig(**section)
    assert says in str(e.value)


def test_without_the_extra_the_config_names_it(monkeypatch):
    for name in [m for m in sys.modules if m.startswith(("openenv", "forge_rl.envs.openenv_factory"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "openenv", None)  # as if not installed
    with pytest.raises(ConfigError) as e:
        env_factory(openenv())
    assert str(e.value) == EXTRA_MISSING
