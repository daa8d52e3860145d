"""Multi-turn environments and tools: the chat-template turns between model replies, the retry and tool
environments, the calculator's safety, and config errors that name the key."""

import asyncio
import re

import pytest
import torch
from transformers import AutoTokenizer

from forge_rl.data.task import TaskExample
from forge_rl.envs import EnvConfig, env_factory
from forge_rl.envs.tools import ToolEnv, calculator
from forge_rl.models import TINY_MODEL_DIR
from forge_rl.loop.multiturn import rollout_env_group
from forge_rl.loop.turn_renderer import TurnRenderer
from forge_rl.loop.rollout import RolloutStats
from forge_rl.rewards.workers import RewardTimeout
from forge_rl.types import Completion, Episode, TrainBatch


def example(answer: str = "46", **columns) -> TaskExample:
    return TaskExample(
        id="t0",
        prompt="12+34=",
        messages=[{"role": "user", "content": "12+34="}],
        answer=answer,
        columns={"answer": answer, **columns},
        where="test row 0",
    )


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


def test_turns_between_replies_continue_the_chat_template_token_for_token(tokenizer):
    r = TurnRenderer(tokenizer)
    messages = [{"role": "user", "content": "12+34="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # a reply that ended with the end-of-turn token (the engine keeps it), then one cut off at max_tokens
    first = tokenizer("45<|im_end|>", add_special_tokens=False)["input_ids"]
    feedback = [{"role": "user", "content": "Wrong. Try again."}]
    ids += first + r.between(feedback, model_stopped=True)
    ids += tokenizer("4", add_special_tokens=False)["input_ids"] + r.between(feedback, model_stopped=False)
    expected = tokenizer.apply_chat_template(
        messages
        + [{"role": "assistant", "content": "45"}, *feedback, {"role": "assistant", "content": "4"}, *feedback],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(ids) == expected


def test_retry_env_credits_a_first_right_answer_more_than_a_corrected_one():
    async def play(replies):
        env = env_factory(EnvConfig(name="retry", max_turns=3))()
        await env.reset(example())
        return [await env.step(r) for r in replies]

    right = asyncio.run(play(["46"]))
    assert right[0].done and right[0].solved and right[0].reward == 1.0
    corrected = asyncio.run(play(["45", " 46 "]))
    assert not corrected[0].done and corrected[0].messages == [{"role": "user", "content": "Wrong. Try again."}]
    assert corrected[1].done and corrected[1].reward == 0.5


def test_tool_env_runs_calls_and_scores_the_final_answer():
    async def play(replies):
        env = ToolEnv(tools=("calculator",))
        await env.reset(example())
        return [await env.step(r) for r in replies]

    steps = asyncio.run(
        play(
            [
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+34"}}\n</tool_call>',
                "<tool_call>{not json}</tool_call>",
                '<tool_call>{"name": "shell", "arguments": {}}</tool_call>',
                "46",
            ]
        )
    )
    assert steps[0].messages == [{"role": "tool", "content": "46"}] and not steps[0].done
    assert steps[1].messages[0]["content"].startswith("error: a tool call is")
    assert steps[2].messages[0]["content"] == "error: no tool 'shell'; tools: ['calculator']"
    assert steps[3].done and steps[3].solved and steps[3].reward == 1.0
    assert ToolEnv.chat_template_kwargs(tools=("calculator",))["tools"][0]["function"]["name"] == "calculator"


@pytest.mark.parametrize(
    "expression, result",
    [
        ("12*(3+4)", "84"),
        ("7/2", "3.5"),
        ("-2**3", "-8"),
        ("10//3", "3"),
        ("__import__('os').system('true')", "error: unsupported"),
        ("2**1000", "error: exponent too large"),
        ("1/0", "error: division by zero"),
        ("open('/etc/passwd')", "error: unsupported"),
        ("1+", "error:"),
        # nested powers pass the exponent check one by one: the result's size stops them (str() of a huge int raised)
        ("((9**64)**64)**2", "error: result too large"),
        ("((9**64)**64)**64", "error: result too large"),
        ("(" * 150 + "1" + ")" * 150, "error:"),
        ("1e300*1e300", "inf"),
        ("2**-2", "0.25"),
    ],
)
def test_calculator_evaluates_arithmetic_and_nothing_else(expression, result):
    assert calculator(expression).startswith(result)


def test_environment_tokens_are_not_response_tokens_of_the_batch():
    env_mask = torch.tensor([False, False, True, True, True, False])
    c = Completion(
        torch.tensor([5, 6, 7]),
        torch.arange(10, 16),
        torch.tensor([-0.5, -0.1, 0, 0, 0, -0.2]),
        torch.tensor([3, 3, 3, 3, 3, 4]),
        "stop",
        env_mask=env_mask,
    )
    batch = TrainBatch.collate([Episode(c, advantage=1.0)], pad_id=0)
    assert batch.response_mask[0].tolist() == [False] * 3 + [True, True, False, False, False, True]
    assert batch.num_response_tokens == 3
    with pytest.raises(ValueError, match="env_mask has 2 entries for 6 response tokens"):
        Completion(c.prompt_ids, c.response_ids, c.logprobs, c.policy_versions, "stop", env_mask=env_mask[:2])


@pytest.mark.parametrize(
    "cfg, message",
    [
        (dict(name="chess"), "env.name='chess': use one of"),
        (dict(name="retry", args={"feedbak": "no"}), r"env.args \['feedbak'\] do not fit"),
        (dict(name="tools", args={"tools": ["shell"]}), r"unknown tools \['shell'\]"),
        (dict(name="forge_rl.rewards.exact_match:exact_match"), "is not a forge_rl.envs.Environment subclass"),
        (dict(name="forge_rl.envs.base:Environment"), r"does not override step\(reply\)"),
    ],
)
def test_bad_environment_config_is_named(cfg, message):
    with pytest.raises(ValueError, match=message):
        env_factory(EnvConfig(**cfg))
    with pytest.raises(ValueError, match="env.max_turns must be >= 1"):
        EnvConfig(name="retry", max_turns=0)


def test_every_tool_failure_is_a_message_for_the_model():
    env = ToolEnv(tools=("calculator", "python"))
    for payload, message in [
        ('{"name": "calculator", "arguments": {"expr": "1"}}', "error: calculator: TypeError: calculator() got an"),
        ('{"name": "calculator", "arguments": [1, 2]}', "error: calculator: TypeError"),
        ('["calculator"]', "error: a tool call is"),
        ('{"name": "calculator", "arguments": {"expression": "((9**64)**64)**2"}}', "error: result too large"),
    ]:
        assert env.run_call(payload).startswith(message), payload
    # python answers with a string whether or not this machine has bubblewrap (SandboxUnavailable: a message)
    assert isinstance(env.run_call('{"name": "python", "arguments": {"code": "print(1)"}}'), str)
    assert len(env.run_call('{"name": "calculator", "arguments": {"expression": "' + "1+" * 500 + '1"}}')) <= 2000


def test_a_tool_envs_final_answer_is_scored_in_a_worker_with_the_timeout():
    async def answer(env):
        await env.reset(example())
        return await env.step("46")

    hanging = ToolEnv(reward="tests.support.hostile_rewards:hangs", reward_timeout_s=1.0, reward_workers=1)
    with pytest.raises(RewardTimeout, match="took longer than reward_timeout_s=1.0"):
        asyncio.run(answer(hanging))
    # the run's settings reach the class; env.args win over them
    run = type("Run", (), {"reward_timeout_s": 7.0, "reward_workers": 1, "reward_memory_mb": 2048})()
    made = env_factory(EnvConfig(name="tools", args={"reward_timeout_s": 3.0}), run)()
    assert (made.timeout_s, made.pool.memory_mb) == (3.0, 2048)
    assert asyncio.run(answer(made)).reward == 1.0


class FakeGenerator:
    """The generator's `generate.route`: "45" for every first turn, then `later` (raised if an exception)."""

    def __init__(self, tokenizer, later):
        self.tokenizer, self.later, self.calls = tokenizer, later, 0
        self.generate = self
        self.route = self._route

    async def _route(self, prompt_ids, n=1, **_):
        self.calls += 1
        if self.calls > 1 and isinstance(self.later, Exception):
            raise self.later
        ids = self.tokenizer("45<|im_end|>", add_special_tokens=False)["input_ids"]
        return [
            Completion(
                torch.tensor(prompt_ids),
                torch.tensor(ids),
                torch.zeros(len(ids)),
                torch.zeros(len(ids), dtype=torch.long),
                "stop",
                text="45",
            )
            for _ in range(n)
        ]


class BrokenEnv(ToolEnv):
    async def step(self, reply):
        raise KeyError("the environment's own bug")


@pytest.mark.parametrize(
    "make_env, later, reason, counted",
    [
        (lambda: BrokenEnv(), None, "env_error", 2),
        (
            lambda: env_factory(EnvConfig(name="retry", max_turns=3))(),
            RuntimeError("engine died"),
            "generation_error",
            2,
        ),
        (lambda: env_factory(EnvConfig(name="retry", max_turns=3))(), "too long", "prompt_too_long", 1),
        (lambda: ToolEnv(reward="tests.support.hostile_rewards:segfaults", reward_workers=1), None, "reward_crash", 2),
    ],
)
def test_a_failing_environment_or_generation_drops_its_group_counted(
    tokenizer, make_env, later, reason, counted, capsys
):
    from forge_rl.actors.generator import PromptTooLong

    later = PromptTooLong("prompt of 200 tokens") if later == "too long" else later
    stats = RolloutStats()
    cfg = EnvConfig(name="retry", max_turns=3, max_total_tokens=64)
    group = asyncio.run(
        rollout_env_group(
            example(),
            [1, 2, 3],
            FakeGenerator(tokenizer, later),
            make_env,
            TurnRenderer(tokenizer),
            cfg,
            group_size=2,
            max_tokens=8,
            stats=stats,
        )
    )
    assert group is None and stats.drops[reason] == counted  # prompts for prompt_too_long, else episodes
    assert sum(n for k, n in stats.drops.items() if k != reason) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dropped group")]
    assert len(printed) == 1 and f"({reason})" in printed[0]


AVAILABLE = r"available: \['calculator', 'python'\]$"


@pytest.mark.parametrize(
    "tools, message",
    [
        (0, r"^env.args.tools=0: give a list of tool names, e.g. \[calculator\]; " + AVAILABLE),
        (1.5, r"^env.args.tools=1.5: give a list of tool names, e.g. \[calculator\]; " + AVAILABLE),
        (True, r"^env.args.tools=True: give a list of tool names, e.g. \[calculator\]; " + AVAILABLE),
        (None, r"^env.args.tools=None: give a list of tool names, e.g. \[calculator\]; " + AVAILABLE),
        ("abc", r"^env.args.tools='abc': give a list of tool names, e.g. \[calculator\]; " + AVAILABLE),
        ({"a": 1}, r"^env.args.tools=\{'a': 1\}: give a list of tool names, e.g. \[calculator\]; " + AVAILABLE),
        ([[]], r"^env.args.tools\[0\]=\[\]: give a tool's name; " + AVAILABLE),
        ([{}], r"^env.args.tools\[0\]=\{\}: give a tool's name; " + AVAILABLE),
        (["calculator", 7], r"^env.args.tools\[1\]=7: give a tool's name; " + AVAILABLE),
        (
            ["calculator", "shell"],
            r"^env.args.tools=\['calculator', 'shell'\]: unknown tools \['shell'\]; " + AVAILABLE,
        ),
    ],
)
def test_env_args_tools_must_be_a_list_of_tool_names(tools, message):
    """A scalar, a string, an entry that is not a name or an unknown name: one line naming env.args.tools (or the
    entry), what was given and the tools there are; a ConfigError when the environment is checked, and from
    ToolEnv itself."""
    from forge_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        env_factory(EnvConfig(name="tools", args={"tools": tools}))
    with pytest.raises(ConfigError, match=message):
        ToolEnv(tools=tools)
    assert env_factory(EnvConfig(name="tools", args={"tools": ["python", "calculator"]})).template_kwargs["tools"]


@pytest.mark.parametrize(
    "reward, message",
    [
        ("abc", r"^env.args.reward: reward 'abc': not one of \['code_tests', .*\] and not 'package.module:function'$"),
        (0, r"^env.args.reward=0: give a reward's name, one of \['code_tests', .*\] or 'package.module:function'$"),
        (["math"], r"^env.args.reward=\['math'\]: give a reward's name"),
    ],
)
def test_env_args_reward_is_checked_with_the_environment_not_mid_run(reward, message):
    """The tools environment's reward is checked when the environment is (env_factory: the run's checks), not
    when the first trajectory builds it."""
    from forge_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        env_factory(EnvConfig(name="tools", args={"tools": ["calculator"], "reward": reward}))


@pytest.mark.parametrize("key", ["env", "action"])
@pytest.mark.parametrize("path", ["", ":X", "a.b:", "a.b", ".a:X", "a..b:X", "a.b:X.Y", "a b:X"])
def test_openenv_env_and_action_must_be_package_module_class(key, path):
    from forge_rl.envs.openenv_config import OpenEnvConfig

    given = {"env": "a.b:Env", key: path}
    with pytest.raises(
        ValueError, match=rf"^env.openenv.{key}={re.escape(repr(path))}: write it 'package.module:Class'"
    ):
        OpenEnvConfig(**given)
    assert OpenEnvConfig(env="examples.openenv_addition.env:AdditionEnvironment", action="a.b_c:Action").action
