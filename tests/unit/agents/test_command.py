"""agent.command (forge_rl/agents/command.py, AgentConfig): the setting checked when read, each mistake one line
naming the key; what a program's stdout says its reward is; the environment it runs in (its episode's URL and
key, never the run's). The programs themselves run in tests/integration/test_agent_endpoint.py."""

import sys

import pytest

from forge_rl.agents.command import parse_reward, program_env
from forge_rl.agents.config import AgentConfig
from forge_rl.agents.entry import EpisodeFailed
from forge_rl.agents.verifiers_env import API_KEY_VAR


def test_a_command_is_an_agent():
    agent = AgentConfig(command=[sys.executable, "examples/agents/http_agent.py"])
    assert agent.enabled and agent.name.startswith("command ") and agent.name.endswith("http_agent.py")
    assert not AgentConfig().enabled


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"command": "python3 agent.py"}, "agent.command='python3 agent.py': give the program and its arguments"),
        ({"command": []}, "agent.command=[]: give the program"),
        ({"command": ["python3", 3]}, "as a list of strings"),
        ({"command": ["no-such-program-here"]}, "agent.command[0]='no-such-program-here': no such program on PATH"),
        ({"command": ["python3"], "entry": "a.b:c"}, "agent.entry='a.b:c' and agent.command=['python3']: a run"),
        ({"command": ["python3"], "verifiers": {"env": "gsm8k"}}, "and agent.verifiers.env='gsm8k': a run trains"),
        ({"max_output_bytes": 0}, "agent.max_output_bytes must be >= 1"),
        ({"max_output_bytes": "1MB"}, "agent.max_output_bytes='1MB': give a number of bytes"),
    ],
)
def test_a_bad_command_setting_is_one_line_naming_it(kwargs, says):
    with pytest.raises(ValueError) as e:
        AgentConfig(**kwargs)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "stdout, reward",
    [
        (b"", None),
        (b"\n  \n", None),
        (b"null\n", None),
        (b'{"reward": null}', None),
        (b"0.5\n", 0.5),
        (b"a log line\n1\n", 1.0),
        (b'{"reward": -2, "turns": 3}\n', -2.0),
    ],
)
def test_the_last_line_of_stdout_is_the_reward(stdout, reward):
    assert parse_reward(stdout, "agent command x") == reward


@pytest.mark.parametrize(
    "stdout, says",
    [
        (b"the answer is 46\n", "printed 'the answer is 46' last on stdout, not JSON"),
        (b'{"reward": "high"}', 'printed \'{"reward": "high"}\' last on stdout'),
        (b"NaN", "printed 'NaN' last on stdout"),
        (b"true", "printed 'true' last on stdout"),
        (b"[1]", "printed '[1]' last on stdout"),
    ],
)
def test_stdout_that_is_no_reward_fails_the_episode(stdout, says):
    with pytest.raises(EpisodeFailed) as e:
        parse_reward(stdout, "agent command x")
    assert e.value.reason == "agent_reward" and says in str(e.value) and "\n" not in str(e.value)


def test_the_program_gets_its_episodes_url_and_key_and_not_the_runs(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "forge-rl-run-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "a key of the user's")
    env = program_env("http://127.0.0.1:1/episodes/t3/v1", "forge-rl-episode-t3-x")
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:1/episodes/t3/v1"
    assert env["OPENAI_API_KEY"] == "forge-rl-episode-t3-x"
    assert API_KEY_VAR not in env and "forge-rl-run-secret" not in env.values()
