"""Multi-turn environments: the model takes a turn, the environment answers, until it says done.

    class MyEnv(Environment):
        async def reset(self, example):                 # a TaskExample: prompt, answer, the row's columns
            self.answer = example.answer
        async def step(self, reply):                     # the model's turn, as text
            if reply.strip() == self.answer:
                return EnvStep(reward=1.0, done=True)
            return EnvStep(messages=[{"role": "user", "content": "No. Try again."}])

The rollout (forge_rl/loop/multiturn.py) continues one token sequence turn after turn: the messages a step returns
are rendered with the tokenizer's chat template and appended as tokens the loss never sees (masked), the
model's own tokens keep their behaviour logprobs and policy versions. A trajectory's reward is the sum of its
steps' rewards; group advantages compare whole trajectories. An environment instance lives for one
trajectory, so it may keep state.

Environments are named in config (`env.name`): a key of `ENVIRONMENTS` or "package.module:Class", built with
`env.args` as keyword arguments. `env.openenv` names an OpenEnv environment instead (forge_rl/envs/openenv.py):
`env.name` is then "openenv".

`reset` may return chat messages: they replace the task's prompt (an environment that poses its own task, as
an OpenEnv one's first observation does); or an EnvStep, whose messages may show its images. `close` is called
when the trajectory ends, however it ends.

For a vision-language model a step's observation may show images: `EnvStep(messages=[{"role": "user", "content":
"Now: <image>"}], images=[png_bytes])`. The model's next turn sees them and every earlier image of the trajectory
(the task row's too), and the trajectory keeps them for the trainer (forge_rl/loop/turn_images.py).
"""

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from forge_rl.envs.environment import Environment, EnvStep  # noqa: F401 - re-exported: environments import them here
from forge_rl.envs.openenv_config import EXTRA_MISSING, OpenEnvConfig
from forge_rl.errors import ConfigError

ENVIRONMENTS = {"retry": "forge_rl.envs.retry:RetryEnv", "tools": "forge_rl.envs.tools:ToolEnv"}
OPENENV = "openenv"  # env.name when env.openenv is given
OPENENV_EXTRA = ("openenv", "fastapi", "uvicorn", "websockets", "fastmcp")  # what the `envs` extra installs


@dataclass
class EnvConfig:
    name: str | None = None  # None: single-turn (the reward functions score the one completion)
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment's class
    max_turns: int = 2  # model turns per trajectory at most
    max_total_tokens: int = 64  # response tokens per trajectory at most, the environment's included
    openenv: OpenEnvConfig | None = None  # an OpenEnv environment (forge_rl/envs/openenv.py); sets name "openenv"

    def __post_init__(self) -> None:
        if self.openenv is not None:
            if self.name not in (None, OPENENV):
                raise ValueError(f"env.name={self.name!r} and env.openenv: give one (env.openenv sets the name)")
            if self.args:
                raise ValueError("env.args: an OpenEnv environment's arguments are env.openenv.args")
            self.name = OPENENV
        elif self.name == OPENENV:
            raise ValueError("env.name=openenv needs the env.openenv section (env.openenv.env or env.openenv.url)")
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 1:
            raise ValueError(f"env.max_total_tokens must be >= 1, got {self.max_total_tokens}")


class _Factory:
    """Makes a fresh environment per trajectory; `template_kwargs` are the class's."""

    def __init__(self, cls: type, args: dict[str, Any]):
        self.cls, self.args = cls, args
        self.template_kwargs = cls.chat_template_kwargs(**args)
        self.failures_in_a_row = 0  # groups the environment failed on since one succeeded (multiturn.py)

    def __call__(self) -> Environment:
        return self.cls(**self.args)


def _openenv_factory() -> Callable:
    """forge_rl/envs/openenv_factory.py's factory; a ConfigError naming the extra when openenv is not installed."""
    try:
        from forge_rl.envs.openenv_factory import openenv_factory
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPENENV_EXTRA:
            raise ConfigError(EXTRA_MISSING) from None
        raise
    return openenv_factory


# The run's settings an environment's class may take (ToolEnv scores its final answer as the reward actor does).
RUN_SETTINGS = ("reward_timeout_s", "reward_workers", "reward_memory_mb")


def env_factory(cfg: EnvConfig, run: Any = None) -> Callable[[], Environment]:
    """A function that makes a fresh environment per trajectory. Fails at once (naming the key) on an unknown
    name or arguments the class does not take. `run` (the run's config) gives the class those of its
    RUN_SETTINGS that its __init__ takes and env.args does not set. With env.openenv, the OpenEnv adapter's
    factory (forge_rl/envs/openenv.py); given `run`, a served environment's server is started (once per run)."""
    if cfg.openenv is not None:
        return _openenv_factory()(cfg, run)
    path = ENVIRONMENTS.get(cfg.name, cfg.name)
    if not path or ":" not in path:
        raise ValueError(f"env.name={cfg.name!r}: use one of {sorted(ENVIRONMENTS)} or 'package.module:Class'")
    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"env.name={cfg.name!r}: cannot import {path} ({e})") from None
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ValueError(f"env.name={cfg.name!r}: {path} is not a forge_rl.envs.Environment subclass")
    if cls.step is Environment.step:  # caught at start, not in the first rollout
        raise ValueError(f"env.name={cfg.name!r}: {path} does not override step(reply) -> EnvStep")
    try:
        inspect.signature(cls).bind(**cfg.args)
    except TypeError as e:
        raise ValueError(f"env.args {sorted(cfg.args)} do not fit {path}: {e}") from None
    params = inspect.signature(cls).parameters
    settings = {k: getattr(run, k) for k in RUN_SETTINGS if k in params and hasattr(run, k)}
    return _Factory(cls, {**settings, **cfg.args})
