"""verifiers environments as a run's agent: `agent.verifiers.env` names a taskset (or a function building a vf.Env);
its tasks become the run's task rows, and each episode is verifiers' own rollout (`vf.Env.run_episode`: its
prompt and system prompt, its harness's chat loop, its stop conditions, its task's @vf.reward functions) with the
episode's base URL as the model endpoint. The episode's reward is the trace's reward (verifiers' weighted sum of its
reward functions); each function's score is kept in the episode's rewards.

    environment = load_environment(cfg.agent.verifiers)           # vf.Env, or one ConfigError line
    cfg.task = verifiers_task(cfg.task, cfg.agent.verifiers, env)  # the taskset's rows, unless a task is given
    play = VerifiersEpisodes(env, model="tiny-warm")               # fn(example, client) -> AgentReward

verifiers resolves tasksets and harnesses by id, a top-level module name: a module given by its dotted path (a taskset
in the user's code, forge_rl's in-process harness) is registered under a flat id (`plugin_id`) so that verifiers'
loader finds it. Everything runs in the run's process, with no network: the in-process harness
(forge_rl/agents/verifiers_harness.py) instead of the stock ones' `uv`-installed chat program, and a local runtime.
"""

import dataclasses
import hashlib
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

from forge_rl.agents.config import VerifiersConfig
from forge_rl.agents.entry import EXTRA, AgentReward
from forge_rl.data.task import TaskConfig
from forge_rl.errors import ConfigError

KEY = "agent.verifiers.env"
API_KEY_VAR = "FORGE_RL_AGENT_API_KEY"  # verifiers reads an endpoint's key from a variable: the run's key
TASK_COLUMN = "vf_task"  # the row's verifiers task data, from which each episode rebuilds its vf.Task
ROWS_DIR = Path(tempfile.gettempdir()) / "forge_rl_verifiers"


def require_verifiers():
    """The `verifiers.v1` package, or a ConfigError naming the extra."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError(f"{KEY} needs the verifiers package, which is not installed: {EXTRA}") from None
    return vf


def plugin_id(name: str, key: str) -> str:
    """The id verifiers' loader resolves `name` by: itself for a top-level name, else the dotted module imported
    and registered under a flat id (verifiers imports ids as top-level modules)."""
    if "." not in name or "/" in name:
        return name
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"{key}={name!r}: cannot import {name} ({e})") from None
    flat = name.replace(".", "__").lower()
    sys.modules.setdefault(flat, module)
    return flat


def load_environment(spec: VerifiersConfig, held_out: bool = False, fresh: bool = False):
    """The vf.Env of `spec` (its held-out taskset when `held_out`), with forge_rl's harness on a local runtime. The
    start-up checks and the task's rows share one load; `fresh`: one of its own (the episodes', whose serving
    resources it holds). None without a verifiers environment (spec.env null: another kind of agent)."""
    if spec.env is None:
        return None
    key = json.dumps([spec.env, spec.args, spec.held_out_args, spec.harness, held_out], sort_keys=True, default=str)
    if fresh or key not in _LOADED:
        env = _load(spec, held_out)
        if fresh:
            return env
        _LOADED[key] = env
    return _LOADED[key]


_LOADED: dict = {}


def _load(spec: VerifiersConfig, held_out: bool):
    vf = require_verifiers()
    args = spec.held_out_args if held_out else spec.args
    key = f"agent.verifiers.{'held_out_args' if held_out else 'args'}"
    if ":" in spec.env:
        return _built_environment(spec.env, args, key)
    harness = plugin_id(spec.harness, "agent.verifiers.harness")
    raw = {
        "taskset": {**args, "id": plugin_id(spec.env, KEY)},
        "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"}},
    }
    try:
        return vf.load_environment(vf.resolve_env_config(raw))
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{KEY}={spec.env!r} or agent.verifiers.harness={spec.harness!r} is not found ({str(e).split('.')[0]}): "
            "give an installed taskset id or an importable module that exports its vf.Taskset in __all__"
        ) from None
    except Exception as e:
        raise ConfigError(f"{KEY}={spec.env!r} with {key}={args}: verifiers could not load it: {_line(e)}") from None


def _built_environment(path: str, args: dict, key: str):
    """`package.module:function`'s vf.Env, the function called with `args`."""
    import verifiers.v1 as vf

    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{KEY}={path!r}: cannot import it ({_line(e)})") from None
    try:
        env = fn(**args)
    except Exception as e:
        raise ConfigError(f"{KEY}={path!r} raised {type(e).__name__} with {key}={args}: {_line(e)}") from None
    if not isinstance(env, vf.Env):
        raise ConfigError(f"{KEY}={path!r} returned a {type(env).__name__}; return a verifiers.v1 Env")
    return env


def _line(e: BaseException) -> str:
    """`e` in one line: a validation error's first field and what is wrong with it (pydantic's first line only
    counts them), else the first line of its message."""
    errors = getattr(e, "errors", None)
    if callable(errors) and type(e).__name__ == "ValidationError" and (found := errors()):
        where = ".".join(str(part) for part in found[0].get("loc", ()))
        return f"{where}: {found[0].get('msg', '')}"[:300]
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def task_rows(env, max_rows: int) -> list[dict]:
    """Each task of the env's taskset as a row: its id, the prompt messages verifiers sends first, its answer
    (where its data has one), and its whole task data (TASK_COLUMN)."""
    rows = []
    try:
        for task in env.taskset.take(max_rows) if not env.taskset.bounded else env.taskset:
            if len(rows) >= max_rows:
                break
            rows.append(_row(task.data))
    except Exception as e:  # the taskset's own load(): a missing file, a bad row
        raise ConfigError(
            f"{KEY}={env.taskset.config.id!r}: its taskset raised {type(e).__name__} while its tasks were read: "
            f"{_line(e)}"
        ) from None
    if not rows:
        raise ConfigError(f"{KEY}={env.taskset.config.id!r}: its taskset yields no task; check agent.verifiers.args")
    return rows


def _row(data) -> dict:
    """One task's row (task_rows)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt or []]
    row = {"id": str(data.id if data.id is not None else data.idx), "prompt": messages}
    if getattr(data, "answer", None) is not None:
        row["answer"] = str(data.answer)
    row[TASK_COLUMN] = data.model_dump(mode="json", exclude_none=True)
    return row


def verifiers_task(task: TaskConfig, spec: VerifiersConfig) -> TaskConfig:
    """The run's task: `task` as given when it names a source of its own, else the taskset's rows (and its
    held-out taskset's, with agent.verifiers.held_out_args), written once as JSONL files the dataset reads."""
    if task.source != TaskConfig.source:  # the user's own rows: each episode builds its task data from them
        return task
    train = task_rows(load_environment(spec), spec.max_rows)
    held_out = task_rows(load_environment(spec, held_out=True), spec.max_rows) if spec.held_out_args else None
    digest = hashlib.sha256(json.dumps([train, held_out], sort_keys=True).encode()).hexdigest()[:16]
    folder = ROWS_DIR / digest
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in (("train", train), ("held_out", held_out)):
        if rows is not None:
            paths[name] = folder / f"{name}.jsonl"
            if not paths[name].exists():  # content-addressed: an existing file holds these rows
                tmp = paths[name].with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
                tmp.replace(paths[name])
    return dataclasses.replace(
        task,
        source=str(paths["train"]),
        held_out=str(paths["held_out"]) if held_out is not None else task.held_out,
        prompt_column="prompt",
        answer_column="answer" if all("answer" in r for r in train) else None,
        id_column="id",
        system_prompt=None,  # the rows' messages carry the taskset's system prompt
        chat_template=True,
    )


class VerifiersEpisodes:
    """The agent function of a verifiers environment: fn(example, client) plays one episode with verifiers'
    rollout against the client's base URL and returns the trace's reward with each reward function's score."""

    def __init__(self, env, model: str):
        self.env, self.model = env, model
        self.task_type = type(env.taskset).task_type()
        self.data_type = _data_type(self.task_type)
        self._serving = None  # verifiers' serving resources (its interception server), opened by the first episode

    def use_run_key(self, key: str) -> None:
        """The endpoint's run key, which every episode's calls carry (AgentRunner gives it): verifiers' interception
        server keeps one client per endpoint config for as long as it serves, so its episodes share one config,
        the root URL's, and a key of one episode would not do for the others. verifiers reads it from a variable
        of the run's process (the code sandbox clears its environment: forge_rl/rewards/sandbox.py)."""
        os.environ[API_KEY_VAR] = key

    async def __call__(self, example, client) -> AgentReward:
        import verifiers.v1 as vf

        from forge_rl.agents.server import episode_model  # the endpoint's modules: not for the start-up checks

        if self._serving is None:
            serving = self.env.serving()
            await serving.__aenter__()
            self._serving = serving
        task = self.task_type(self._task_data(example), self.env.taskset.config.task)
        # one endpoint config for every episode, the episode named in the model: verifiers' interception server
        # keeps a client (a connection pool) per distinct endpoint config, for as long as it serves
        root, model = episode_model(str(client.base_url), self.model)
        ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=root, api_key_var=API_KEY_VAR))
        episode = await self.env.run_episode(task, ctx)
        if not episode.ok:
            errors = [f"{e.type}: {e.message}" for e in episode.errors]
            errors += [f"{e.type}: {e.message}" for t in episode.traces for e in getattr(t, "errors", [])]
            raise RuntimeError(f"verifiers episode failed: {(errors or ['no trace'])[0]}"[:400])
        trace = episode.traces[-1]
        parts = {name: float(r.value) for name, r in trace.rewards.items() if r is not None}
        return AgentReward(trace.reward, parts)

    def _task_data(self, example):
        """The episode's verifiers task data: the row's own (TASK_COLUMN), or one built from a row of the user's
        task (its columns as the data's fields, its prompt as the prompt)."""
        if TASK_COLUMN in example.columns:
            return self.data_type.model_validate(example.columns[TASK_COLUMN])
        return self.data_type.model_validate({**example.columns, "prompt": example.prompt})

    async def close(self) -> None:
        """verifiers' serving resources, if an episode opened them."""
        serving, self._serving = self._serving, None
        if serving is not None:
            await serving.__aexit__(None, None, None)


def _data_type(task_type: type):
    from verifiers.v1 import Task, TaskData
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(task_type, TaskData, origin=Task) or TaskData
