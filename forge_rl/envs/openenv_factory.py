"""`env_factory` for `env.openenv`: checks the section against the environment (class, Action, text fields, tools,
reset keywords), starts the run's server where it is served, and makes one OpenEnvTrajectory per trajectory.

Called by the run's start-up checks (no `run`: nothing starts, the chat template's tools are found), its rollouts
and each evaluation (with `run`, the run's config: the server is started on the first such call and shared by the
later ones, forge_rl/envs/openenv_server.py).
"""

import asyncio
import threading
import time
from typing import Any

from openenv.core import GenericEnvClient
from openenv.core.env_server import ListToolsAction, MCPEnvironment

from forge_rl.envs.environment import EVAL_TRAJECTORIES
from forge_rl.envs.openenv import OpenEnvTrajectory, Reading
from forge_rl.envs.openenv_app import action_class, environment_class, observation_class
from forge_rl.envs.openenv_config import OpenEnvConfig
from forge_rl.envs.openenv_server import server_for
from forge_rl.envs.openenv_session import (
    CONNECT_TIMEOUT_S,
    InProcessSession,
    RemoteSession,
    accepted_keywords,
    connection_lost,
)
from forge_rl.errors import ConfigError

SERVER_EXIT_GRACE_S = 2.0  # how long a lost connection waits to see whether the server's process exited
CLIENT_SLACK_S = 5.0  # the WebSocket client's own timeout, past the step's limit (which comes first)


def _in_thread(fn, timeout_s: float) -> Any:
    """fn() on a thread of its own (its own event loop where it needs one): start-up checks run inside the run's
    loop, where neither a blocking MCP call nor asyncio.run may."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"took longer than {timeout_s:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _tool_schemas(tools: list) -> list[dict]:
    """MCP tools as the chat template's `tools` (OpenAI function schemas)."""
    schemas = []
    for t in tools:
        t = t if isinstance(t, dict) else t.model_dump()
        function = {"name": t["name"], "description": t.get("description", ""), "parameters": t["input_schema"]}
        schemas.append({"type": "function", "function": function})
    return schemas


def _class_tools(cls: type, args: dict) -> list[dict]:
    """The tools an MCPEnvironment class lists (an instance of it, closed after)."""
    if MCPEnvironment is None or not issubclass(cls, MCPEnvironment):
        return []

    def listed() -> list:
        env = cls(**args)
        try:
            return env.step(ListToolsAction()).tools
        finally:
            env.close()

    return _tool_schemas(_in_thread(listed, 60.0))


def _served_schema_and_tools(url: str) -> tuple[dict, list[dict]]:
    """A running server's Action schema (GET /schema) and its tools (a list_tools step; none if it refuses)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url.rstrip('/')}/schema", timeout=CONNECT_TIMEOUT_S) as reply:
        action_schema = json.loads(reply.read())["action"]

    async def tools() -> list:
        client = GenericEnvClient(base_url=url, connect_timeout_s=CONNECT_TIMEOUT_S, message_timeout_s=30.0)
        try:
            return (await client.step({"type": "list_tools"})).observation.get("tools", [])
        except RuntimeError:  # not an MCP environment: its Action refuses list_tools
            return []
        finally:
            await client.close()

    return action_schema, _tool_schemas(_in_thread(lambda: asyncio.run(tools()), 60.0))


def text_field(schema: dict, key: str, what: str) -> str:
    """The one string property of a JSON schema (metadata and MCP's `type` aside), or a ConfigError naming `key`."""
    props = {k: v for k, v in schema.get("properties", {}).items() if k not in ("metadata", "type")}
    strings = [k for k, v in props.items() if v.get("type") == "string"]
    if len(strings) == 1:
        return strings[0]
    if len(props) == 1:
        return next(iter(props))
    raise ConfigError(f"{key}: {what} has fields {sorted(props)}, not one string field: name the one to use")


class OpenEnvFactory:
    """Makes the run's OpenEnvTrajectory per trajectory; holds what they share (section, sessions, counters)."""

    def __init__(self, env_cfg, run: Any = None):
        self.env_cfg, self.section = env_cfg, env_cfg.openenv
        self.run_seed = int(getattr(run, "seed", 0) or 0)
        self.failures_in_a_row = 0  # groups the environment failed on since one succeeded (multiturn.py)
        self.refused = 0  # replies the Action type refused (the trajectory ended with reward 0)
        self.server = None
        section: OpenEnvConfig = self.section
        if section.env is not None:
            self.cls = environment_class(section.env)
            self.action_cls = action_class(self.cls, section.action)
            self._check_reset_keywords()
            schema, tools = self.action_cls.model_json_schema(), _class_tools(self.cls, section.args)
            self._check_observation(observation_class(self.cls))
        else:
            try:
                schema, tools = _served_schema_and_tools(section.url)
            except Exception as e:  # noqa: BLE001 - unreachable, not OpenEnv: one line naming the URL
                raise ConfigError(f"env.openenv.url={section.url!r}: {type(e).__name__}: {e}") from None
        action_field = section.action_field or text_field(schema, "env.openenv.action_field", "the Action")
        if action_field not in schema.get("properties", {}):
            raise ConfigError(
                f"env.openenv.action_field={action_field!r}: the Action has {sorted(schema['properties'])}"
            )
        self.reading = Reading(action_field, section.observation_field, has_tools=bool(tools))
        self.template_kwargs = {"tools": tools} if tools else {}
        if section.serve and run is not None:
            self.server = server_for(env_cfg, self._concurrency(run), getattr(run, "output_dir", None))

    def _check_reset_keywords(self) -> None:
        accepted = accepted_keywords(self.cls.reset)
        given = set(self.section.reset_args) | set(self.section.reset_columns.values())
        if accepted is not None and (unknown := sorted(given - accepted)):
            raise ConfigError(
                f"env.openenv.reset_args/reset_columns give {unknown}, which {self.cls.__name__}.reset does not take"
            )

    def _check_observation(self, observation_cls: type) -> None:
        field = self.section.observation_field
        fields = set(observation_cls.model_fields) - {"reward", "done", "metadata"}
        if field is not None and observation_cls.__name__ != "Observation" and field not in fields:
            raise ConfigError(
                f"env.openenv.observation_field={field!r}: {observation_cls.__name__} has {sorted(fields)}"
            )

    def _concurrency(self, run: Any) -> int:
        """The server's sessions: every trajectory the run may have in flight, or env.openenv.max_concurrency."""
        in_flight = int(run.rollout_tasks) * int(run.group_size) + EVAL_TRAJECTORIES
        wanted = self.section.max_concurrency
        if wanted is not None and wanted < in_flight:
            raise ConfigError(
                f"env.openenv.max_concurrency={wanted} is fewer sessions than the run's trajectories in flight "
                f"({in_flight}: rollout_tasks x group_size + {EVAL_TRAJECTORIES} held-out): raise it or leave it unset"
            )
        return wanted or in_flight

    def open_session(self):
        timeout = self.section.step_timeout_s + CLIENT_SLACK_S
        if self.section.url is not None:
            return RemoteSession(self.section.url, timeout)
        if self.section.serve:
            if self.server is None:
                raise RuntimeError(
                    "a served OpenEnv environment is played with the run's settings: env_factory(env, run)"
                )
            return RemoteSession(self.server.url, timeout)
        return InProcessSession(self.cls, self.section.args, self.action_cls)

    def reset_columns(self, example: Any) -> dict[str, Any]:
        """The example's columns its reset takes (env.openenv.reset_columns: column -> keyword)."""
        kwargs = {}
        for column, keyword in self.section.reset_columns.items():
            if column in example.columns:
                kwargs[keyword] = example.columns[column]
            elif column == "prompt":
                kwargs[keyword] = example.prompt
            else:
                raise ValueError(
                    f"env.openenv.reset_columns: example {example.id} has no column {column!r} "
                    f"(it has {sorted(example.columns)} and the prompt)"
                )
        return kwargs

    async def server_down(self, error: Exception) -> str | None:
        """Why the run's server is gone, or None (running, or not served by the run). After a lost connection
        (`error`) its process gets a moment to be seen gone: a killed server's socket closes a little before
        its exit status is there to read."""
        if self.server is None:
            return None
        deadline = time.monotonic() + (SERVER_EXIT_GRACE_S if connection_lost(error) else 0.0)
        while (down := self.server.down()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return down

    def refused_action(self, error: Exception) -> None:
        self.refused += 1
        if self.refused == 1:
            print(
                f"env.openenv: a reply the environment's Action refused ends its trajectory with reward 0 ({error}); "
                "later ones are not printed",
                flush=True,
            )

    def __call__(self) -> OpenEnvTrajectory:
        return OpenEnvTrajectory(self)


def openenv_factory(env_cfg, run: Any = None) -> OpenEnvFactory:
    """The factory for `env_cfg.openenv`: a ConfigError (one line, naming the key) for what does not fit."""
    try:
        return OpenEnvFactory(env_cfg, run)
    except ValueError as e:
        raise ConfigError(str(e)) from None
