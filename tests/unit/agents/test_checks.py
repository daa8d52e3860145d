"""agent.* checked before any engine starts (forge_rl/recipes/grpo_checks.py's check_agent, AgentConfig): each
mistake is one line naming the key and what to do."""

import copy
import sys
from functools import cache

import pytest

from forge_rl.config import ConfigError, load_config
from forge_rl.recipes.grpo_checks import check_agent
from forge_rl.recipes.grpo_config import GRPOConfig
from tests.conftest import REPO

AGENT = "examples.agents.retry_agent:solve"


def agent_with_one_argument(example):
    return 1.0


NOT_A_FUNCTION = 3


def _config(*overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", list(overrides))


@cache
def _tiny() -> GRPOConfig:
    return _config()


def _with(*overrides: str) -> GRPOConfig:
    """tiny.yaml with `key=value` overrides set on a copy (the keys' values are checked here, not when read)."""
    cfg = copy.deepcopy(_tiny())
    for override in overrides:
        key, _, value = override.partition("=")
        *path, name = key.split(".")
        target = cfg
        for part in path:
            target = getattr(target, part)
        setattr(target, name, {"true": True}.get(value, value))
    return cfg


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_agent(_with(*overrides))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_demo_agent_passes_and_no_agent_is_the_default():
    check_agent(_with(f"agent.entry={AGENT}"))
    assert not _tiny().agent.enabled


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["agent.entry=examples.agents.nope:solve"], ["agent.entry", "cannot import examples.agents.nope"]),
        (["agent.entry=examples.agents.retry_agent:nope"], ["agent.entry", "has no 'nope'"]),
        ([f"agent.entry={__name__}:agent_with_one_argument"], ["agent.entry", "must take (example, client)"]),
        ([f"agent.entry={__name__}:NOT_A_FUNCTION"], ["agent.entry", "is a int, not a function"]),
        ([f"agent.entry={AGENT}", "env.name=retry"], ["agent.entry", "env.name='retry'", "one of them to null"]),
        ([f"agent.entry={AGENT}", "trainer.keep_routing=true"], ["trainer.keep_routing=true", "agent.entry"]),
        ([f"agent.entry={AGENT}", "overlong.filter=true"], ["overlong.*", "agent.entry"]),
        ([f"agent.entry={AGENT}", "stale_in_flight=requeue"], ["stale_in_flight=requeue", "agent.entry"]),
        (["agent.command=[python3, examples/agents/http_agent.py]", "env.name=retry"], ["agent.command", "env.name"]),
        (["agent.command=[python3, examples/agents/http_agent.py]", "overlong.filter=true"], ["with agent.command"]),
    ],
)
def test_a_bad_agent_setting_is_one_line_naming_it(overrides, names):
    line = _refused(*overrides)
    assert all(name in line for name in names), line


@pytest.mark.parametrize(
    "override, names",
    [
        ("agent.entry=no_colon", ["agent.entry", "'package.module:function'"]),
        ("agent.non_prefix=merge", ["agent.non_prefix", "'split', 'refuse'"]),
        ("agent.episode_timeout_s=0", ["agent.episode_timeout_s", "> 0"]),
        ("agent.port=70000", ["agent.port"]),
        ("agent.workers=-1", ["agent.workers=-1", ">= 0"]),
        ("agent.episodes_per_worker=0", ["agent.episodes_per_worker=0", ">= 1"]),
        ("agent.workers=two", ["agent.workers"]),
        ("agent.gateway.host='my host'", ["agent.gateway.host='my host'", "0.0.0.0"]),
        ("agent.gateway.process=sometimes", ["agent.gateway.process"]),
        ("agent.gateway.replicas=0", ["agent.gateway.replicas=0", ">= 1"]),
        (["agent.gateway.replicas=2", "agent.gateway.process=false"], ["agent.gateway.replicas=2", "process: true"]),
    ],
)
def test_a_bad_agent_value_is_refused_when_read(override, names):
    with pytest.raises(ConfigError) as e:
        _config(*([override] if isinstance(override, str) else override))
    assert all(name in str(e.value) for name in names) and "\n" not in str(e.value)


def test_a_command_agent_passes_the_checks_and_is_read_from_the_command_line():
    cfg = _config("agent.command=[python3, examples/agents/http_agent.py]")
    assert cfg.agent.command == ["python3", "examples/agents/http_agent.py"] and cfg.agent.enabled
    check_agent(cfg)
    with pytest.raises(ConfigError) as e:
        _config("agent.command=[no-such-program-here]")
    assert "agent.command[0]='no-such-program-here'" in str(e.value) and "\n" not in str(e.value)


def test_without_the_openai_package_the_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # a fault: the package not installed
    line = _refused(f"agent.entry={AGENT}")
    assert "pip install 'forge_rl[agents]'" in line and "agent.entry" in line
