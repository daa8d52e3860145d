"""`env.openenv`: an OpenEnv environment as a run's multi-turn task (forge_rl/envs/openenv.py plays it).

    env:
      openenv:
        env: examples.openenv_addition.env:AdditionEnvironment   # an OpenEnv Environment class...
        serve: true                        # ...run in a local server the run starts (else: in this process)
        # url: http://127.0.0.1:8000       # or a server already running (instead of `env`)
        action_field: answer               # the Action field the model's reply goes into
        observation_field: prompt          # the Observation field the model reads
        step_timeout_s: 30

Torch-free and openenv-free: the config is read and checked without either (openenv is an optional extra).
"""

import re
from dataclasses import dataclass, field
from typing import Any

# "package.module:Class": a module's dotted name and a name in it (what openenv_app.import_path imports)
CLASS_PATH = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*:[^\W\d]\w*")
EXTRA_MISSING = "env.openenv: needs the optional extra: pip install 'forge_rl[envs]'"


@dataclass
class OpenEnvConfig:
    env: str | None = None  # "package.module:Class", an openenv Environment subclass
    serve: bool = False  # true: `env` runs in a local uvicorn server (create_app) the run owns; false: in process
    url: str | None = None  # instead of `env`: a running OpenEnv server (http://host:port)
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of `env`'s class
    action: str | None = None  # "package.module:Class", the Action class; default: the annotation of env.step
    action_field: str | None = None  # the Action field the reply's text fills; default: its only string field
    observation_field: str | None = None  # the Observation field shown to the model; default: its only string field
    reset_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of every reset
    reset_columns: dict[str, str] = field(default_factory=dict)  # task column -> reset keyword, per example
    solved_above: float = 0.0  # a trajectory whose return exceeds this counts as solved (held-out accuracy)
    step_timeout_s: float = 60.0  # a reset or step taking longer fails its group (env_timeout)
    start_timeout_s: float = 120.0  # serve: how long the server gets to answer /health
    max_concurrency: int | None = None  # serve: the server's sessions; default: the run's trajectories in flight

    def __post_init__(self) -> None:
        if (self.env is None) == (self.url is None):
            raise ValueError("env.openenv: give one of env.openenv.env ('package.module:Class') or env.openenv.url")
        if self.url is not None and (self.serve or self.args or self.action):
            raise ValueError(
                "env.openenv.url names a running server: env.openenv.serve, args and action apply to env.openenv.env"
            )
        if self.env is not None and not CLASS_PATH.fullmatch(self.env):
            raise ValueError(f"env.openenv.env={self.env!r}: write it 'package.module:Class'")
        if self.action is not None and not CLASS_PATH.fullmatch(self.action):
            raise ValueError(
                f"env.openenv.action={self.action!r}: write it 'package.module:Class' (the Action class), or leave "
                "it out for the Action that env.openenv.env's step annotates"
            )
        if self.url is not None and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"env.openenv.url={self.url!r}: give http://host:port")
        if self.step_timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("env.openenv.step_timeout_s and start_timeout_s must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"env.openenv.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_concurrency is not None and not self.serve:
            raise ValueError("env.openenv.max_concurrency sets the server the run starts: it needs serve: true")

    def where(self) -> str:
        """What this section runs, for messages: the class (and how) or the URL."""
        if self.url is not None:
            return f"the OpenEnv server at {self.url}"
        return f"{self.env} ({'served' if self.serve else 'in process'})"
