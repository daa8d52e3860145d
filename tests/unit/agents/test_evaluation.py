"""A failing held-out evaluation is reported by cause (forge_rl/loop/eval.py's EvalFailures): one line per cause
with how many examples it cost and the first one's id, however many held-out examples fail, for an agent's
evaluation episodes (forge_rl/agents/evaluation.py) and for an environment's trajectories. The faults are injected
where they happen: an agent runner whose episodes fail as AgentRunner.episode reports it, environments that raise."""

import asyncio
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from forge_rl.agents.entry import EpisodeFailed
from forge_rl.data.task import TaskExample
from forge_rl.envs.base import EnvConfig
from forge_rl.envs.environment import EnvError, Environment
from forge_rl.loop.eval import EvalFailures, evaluate_env_summarised, evaluate_held_out
from forge_rl.loop.turn_renderer import TurnRenderer
from forge_rl.models import model_path

N = 50


def examples(n: int = N) -> list[TaskExample]:
    return [
        TaskExample(f"row{i}", "12+34=", [{"role": "user", "content": "12+34="}], "46", {}, f"rows:{i}", "12+34=")
        for i in range(n)
    ]


class FailingAgents:
    """AgentRunner's `episode` as it ends when the agent fails: most episodes raise, every seventh times out, and
    the first example's episode is solved (reward 1). The later an example, the sooner it fails: the line names
    the first example of its cause all the same."""

    async def episode(self, example, trained: bool):
        assert not trained
        i = int(example.id[3:])
        await asyncio.sleep((N - i) / 1000)
        if i == 0:
            return object(), 1.0
        if i % 7 == 0:
            raise EpisodeFailed("agent_timeout", "agent a:b did not return within agent.episode_timeout_s=2")
        raise EpisodeFailed("agent_error", f"episode e{i}: agent a:b raised ValueError: bad row {i}\nTraceback ...")


def test_a_failing_agent_evaluation_is_one_line_per_cause(capsys):
    cfg = SimpleNamespace(task=SimpleNamespace(eval_reward="exact_match"), rewards=[])
    scores = asyncio.run(evaluate_held_out(cfg, None, None, examples(), None, "exact_match", agents=FailingAgents()))
    assert scores == {"eval/accuracy": 1 / N, "eval/reward": 1 / N}
    lines = capsys.readouterr().out.splitlines()
    timeouts = len([i for i in range(1, N) if i % 7 == 0])
    assert lines == [
        f"evaluation: {N - 1 - timeouts} of {N} held-out examples failed (agent_error), scored as not solved; the "
        "first, example row1: episode e1: agent a:b raised ValueError: bad row 1",
        f"evaluation: {timeouts} of {N} held-out examples failed (agent_timeout), scored as not solved; the first, "
        "example row7: agent a:b did not return within agent.episode_timeout_s=2",
    ]


class NoSandbox(EnvError):
    reason = "env_sandbox"


class BrokenEnv(Environment):
    """An environment that cannot start: no sandbox for even rows, its own bug for odd ones."""

    async def reset(self, example):
        if int(example.id[3:]) % 2 == 0:
            raise NoSandbox("bubblewrap is not installed")
        raise KeyError("board")


@pytest.mark.parametrize("make_env", [BrokenEnv, lambda: (_ for _ in ()).throw(OSError("too many open files"))])
def test_a_failing_environment_evaluation_is_one_line_per_cause(capsys, make_env):
    renderer = TurnRenderer(AutoTokenizer.from_pretrained(model_path("tiny-warm")))
    result = asyncio.run(evaluate_env_summarised(None, examples(), make_env, renderer, EnvConfig(), max_tokens=8))
    assert result["accuracy"] == 0.0 and result["n"] == N
    lines = capsys.readouterr().out.splitlines()
    if make_env is BrokenEnv:
        assert lines == [
            f"evaluation: {N // 2} of {N} held-out examples failed (env_sandbox), scored as not solved; the first, "
            "example row0: NoSandbox: bubblewrap is not installed",
            f"evaluation: {N // 2} of {N} held-out examples failed (env_error), scored as not solved; the first, "
            "example row1: KeyError: 'board'",
        ]
    else:  # the factory itself fails
        assert lines == [
            f"evaluation: {N} of {N} held-out examples failed (env_error), scored as not solved; the first, example "
            "row0: OSError: too many open files"
        ]


def test_a_long_error_is_cut_to_one_line():
    failures = EvalFailures(3)
    failures.add("a", "agent_error", "x" * 1000 + "\nsecond line")
    failures.add("b", "agent_error", "other")
    (line,) = failures.lines()
    assert len(line) == 300 and "2 of 3" in line and "example a" in line and "second" not in line
