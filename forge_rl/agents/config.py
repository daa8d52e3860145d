"""The `agent` section of a run's config: an agent written against the `openai` client, trained through the run's
OpenAI-compatible endpoint (forge_rl/agents/server.py). Torch-free and vLLM-free, so a config is read and checked
in a moment; what is checked against the rest of the run is forge_rl/agents/checks.py."""

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

NON_PREFIX = ("split", "refuse")
IN_PROCESS_HARNESS = "forge_rl.agents.verifiers_harness"  # verifiers' chat loop in the run's process, no `uv`


@dataclass
class VerifiersConfig:
    """A verifiers environment trained through the endpoint (forge_rl/agents/verifiers_env.py, docs/agents.md)."""

    # its taskset: an installed taskset id as verifiers takes it ("gsm8k", "owner/name@1.0"), a module exporting its
    # vf.Taskset in __all__ ("my_pkg.my_taskset"), or "package.module:function" returning a built vf.Env. null: none
    env: str | None = None
    args: dict[str, Any] = field(default_factory=dict)  # the taskset's config fields for the training rows
    # the taskset's config fields for the held-out rows (e.g. {split: test}); null: task.held_out_fraction applies
    held_out_args: dict[str, Any] | None = None
    harness: str = IN_PROCESS_HARNESS  # the harness that plays each episode: a verifiers harness id or module
    max_rows: int = 100_000  # rows read from a taskset at most (a generated taskset may be endless)

    def __post_init__(self) -> None:
        if self.env is not None and (not isinstance(self.env, str) or not self.env.strip()):
            raise ValueError(f"agent.verifiers.env={self.env!r}: give a taskset id, a module, or 'package.module:fn'")
        for key in ("args", "held_out_args"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"agent.verifiers.{key}={value!r}: give a mapping of the taskset's config fields")
        if self.max_rows < 1:
            raise ValueError(f"agent.verifiers.max_rows must be >= 1, got {self.max_rows}")


@dataclass
class GatewayConfig:
    """Where the agent endpoint is served (forge_rl/agents/gateway.py)."""

    # the address it listens on: 127.0.0.1 (this host only), or 0.0.0.0 / this host's address when agents on the
    # run's other hosts call it (its URLs then name this host)
    host: str = "127.0.0.1"
    # true: a gateway process of its own in front of the generator replicas; false: the run's controller serves it
    # (its event loop then also answers every agent call)
    process: bool = True
    # gateway processes, each on its own port (a fixed agent.port: the first's, the others the ports after it); an
    # episode is opened on the one with the fewest open episodes and served there (forge_rl/agents/gateways.py)
    replicas: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip() or any(c.isspace() for c in self.host):
            raise ValueError(f"agent.gateway.host={self.host!r}: give an address, e.g. 127.0.0.1 or 0.0.0.0")
        if not isinstance(self.process, bool):
            raise ValueError(f"agent.gateway.process={self.process!r}: give true or false")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"agent.gateway.replicas={self.replicas!r}: give a whole number >= 1")
        if self.replicas > 1 and not self.process:
            raise ValueError(
                f"agent.gateway.replicas={self.replicas} with agent.gateway.process=false: the run's controller "
                "serves one endpoint; set process: true for several gateway processes"
            )


@dataclass
class AgentConfig:
    # "package.module:function", called once per episode as fn(example, client) -> float reward or None (the run's
    # reward functions then score the episode's final assistant text). null: no agent, no endpoint
    entry: str | None = None
    # a program run once per episode instead of agent.entry, as [program, arg, ...]: OPENAI_BASE_URL and
    # OPENAI_API_KEY name its episode, the task row comes as JSON on stdin, and the last line of its stdout is its
    # reward as JSON (nothing, or null: the run's rewards score its last reply) (forge_rl/agents/command.py)
    command: list[str] | None = None
    max_output_bytes: int = 1_000_000  # an agent.command program's stdout at most; more fails its episode
    port: int = 0  # the endpoint's port (on agent.gateway.host); 0: a free one, chosen at start
    episode_timeout_s: float = 300.0  # an episode still running after this long fails, and its group is dropped
    max_concurrent_episodes: int = 64  # episodes running at once, the run's training and evaluation together
    # agent-worker processes that play the episodes (forge_rl/agents/worker.py), off the run's controller; a worker
    # that dies is replaced and its episodes' groups dropped. 0: the episodes run in the controller's process
    workers: int = 2
    episodes_per_worker: int = 64  # episodes one worker plays at once
    # a call whose messages do not continue an earlier call's conversation token for token (history edited, context
    # compacted, a template that re-renders earlier turns): "split" the episode into trajectories that each train on
    # their own tokens, or "refuse" the call (HTTP 400) and drop the group
    non_prefix: str = "split"
    tool_parser: str | None = "hermes"  # tool calls in the model's text -> OpenAI tool_calls (Qwen3); null: none
    # a verifiers environment instead of agent.entry: its taskset's rows are the task, verifiers plays each episode
    # against the episode's URL and its task's rewards are the episode's reward
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)  # where the endpoint is served

    def __post_init__(self) -> None:
        if isinstance(self.verifiers, dict):
            self.verifiers = VerifiersConfig(**self.verifiers)
        if isinstance(self.gateway, dict):
            self.gateway = GatewayConfig(**self.gateway)
        given = {"agent.entry": self.entry, "agent.command": self.command, "agent.verifiers.env": self.verifiers.env}
        given = {key: value for key, value in given.items() if value is not None}
        if len(given) > 1:
            both = " and ".join(f"{key}={value!r}" for key, value in given.items())
            raise ValueError(f"{both}: a run trains one agent; set all but one of them to null")
        self._check_command()
        if self.entry is not None and (not isinstance(self.entry, str) or ":" not in self.entry):
            raise ValueError(f"agent.entry={self.entry!r}: give 'package.module:function'")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"agent.port={self.port!r}: give a port number, or 0 for a free one")
        if not self.episode_timeout_s > 0:
            raise ValueError(f"agent.episode_timeout_s must be > 0, got {self.episode_timeout_s}")
        if self.max_concurrent_episodes < 1:
            raise ValueError(f"agent.max_concurrent_episodes must be >= 1, got {self.max_concurrent_episodes}")
        for key, least in (("workers", 0), ("episodes_per_worker", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"agent.{key}={value!r}: give a whole number >= {least}")
        if self.non_prefix not in NON_PREFIX:
            raise ValueError(f"agent.non_prefix={self.non_prefix!r}; choose one of {NON_PREFIX}")
        if self.tool_parser not in (None, "hermes"):
            raise ValueError(f"agent.tool_parser={self.tool_parser!r}; choose 'hermes' (Qwen3's format) or null")

    def _check_command(self) -> None:
        if isinstance(self.max_output_bytes, bool) or not isinstance(self.max_output_bytes, int):
            raise ValueError(f"agent.max_output_bytes={self.max_output_bytes!r}: give a number of bytes")
        if self.max_output_bytes < 1:
            raise ValueError(f"agent.max_output_bytes must be >= 1, got {self.max_output_bytes}")
        if self.command is None:
            return
        if not isinstance(self.command, list) or not self.command or not all(isinstance(a, str) for a in self.command):
            raise ValueError(
                f"agent.command={self.command!r}: give the program and its arguments as a list of strings, "
                "e.g. [python, examples/agents/http_agent.py]"
            )
        program = self.command[0]
        if not _runnable(program):
            raise ValueError(
                f"agent.command[0]={program!r:.100}: no such program on PATH, nor an executable file; give the "
                "program's name or path"
            )

    @property
    def enabled(self) -> bool:
        return self.entry is not None or self.command is not None or self.verifiers.env is not None

    @property
    def name(self) -> str:
        """What runs the episodes, for messages: the entry, the command, or the verifiers environment."""
        if self.entry is not None:
            return self.entry
        if self.command is not None:
            line = " ".join(self.command).replace("\n", "\\n")
            return f"command {line if len(line) <= 120 else line[:117] + '...'}"
        return f"verifiers:{self.verifiers.env}"


def _runnable(program: str) -> bool:
    """Whether `program` names a program on PATH or an executable file (a name no file can have is neither)."""
    try:
        return shutil.which(program) is not None or (os.sep in program and os.access(program, os.X_OK))
    except (ValueError, OSError):  # a NUL in the name, a name too long
        return False
