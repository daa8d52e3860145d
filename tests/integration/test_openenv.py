"""env.openenv served: one server per run, played over WebSocket, and nothing left once the run ends, fails or is
interrupted (no server process, no port held). Against the real openenv package and its real uvicorn server;
the adapter's logic in process is tests/integration/test_openenv_adapter.py's."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import types

import psutil
import pytest

from forge_rl.data.task import TaskExample
from forge_rl.envs import EnvConfig, env_factory
from forge_rl.envs.openenv_config import OpenEnvConfig
from forge_rl.envs.openenv_server import stop_server
from forge_rl.errors import RunStopped
from tests.conftest import REPO, started_in_the_background

ENVS = "tests.support.openenv_envs"
RUN = types.SimpleNamespace(seed=0, rollout_tasks=2, group_size=2, output_dir=None)


def served(env: str = "RecordedAddition", **section) -> EnvConfig:
    section = {"action_field": "answer", "observation_field": "message", **section}
    return EnvConfig(openenv=OpenEnvConfig(env=f"{ENVS}:{env}", serve=True, **section))


def servers_of(parent: int) -> list[psutil.Process]:
    """The OpenEnv servers process `parent` started (forge_rl/envs/openenv_app.py, told its parent's pid)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "forge_rl.envs.openenv_app" in cmd and f'"parent": {parent}' in cmd:
            found.append(p)
    return found


def gone(pid: int, port: int, within_s: float = 15.0) -> bool:
    """The process is gone (a zombie counts as gone) and nothing listens on the port."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            running = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            running = False
        if not running:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) != 0:
                    return True
        time.sleep(0.2)
    return False


def listening(process: psutil.Process) -> list:
    try:
        return [c for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def one_episode(factory, replies: list[str]):
    env = factory()
    try:
        example = TaskExample("t0", "12+34=", [{"role": "user", "content": "12+34="}], "46", {}, "row")
        prompt = await env.reset(example)
        return prompt, [await env.step(r) for r in replies]
    finally:
        await env.close()


def test_a_run_has_one_server_played_over_websocket_one_that_dies_is_named_and_stopping_frees_it():
    cfg = served(reset_columns={"prompt": "question"})
    factory = env_factory(cfg, RUN)
    try:
        assert env_factory(cfg, RUN).server is factory.server  # the rollouts', each evaluation's: the one server
        prompt, steps = asyncio.run(one_episode(factory, ["45", "46"]))
        assert prompt == [{"role": "user", "content": "12+34="}]
        assert [(s.reward, s.done) for s in steps] == [(0.0, False), (0.5, True)]
        time.sleep(1.0)  # the server ends the session after the client left
        assert "Exception" not in factory.server.log_path.read_text()  # an episode's end is no error in its log
        pid, port = factory.server.proc.pid, port_of(factory.server.url)
        os.kill(pid, signal.SIGKILL)  # the server dies mid-run: the next episode's failure names it
        with pytest.raises(Exception, match=r"the OpenEnv server of .*RecordedAddition exited \(status -9\)"):
            asyncio.run(one_episode(factory, ["46"]))
    finally:
        stop_server(cfg)
    assert gone(pid, port) and servers_of(os.getpid()) == []


def test_a_server_that_does_not_start_is_one_line_naming_the_class_and_its_last_stderr_line():
    with pytest.raises(RunStopped) as e:
        env_factory(served("NotConcurrent"), RUN)  # openenv refuses concurrent sessions of it
    message = str(e.value)
    assert "\n" not in message and "NotConcurrent" in message and "ConcurrencyConfigurationError" in message
    assert servers_of(os.getpid()) == []


def test_a_killed_controller_takes_its_server_along():
    script = (
        "import types, time\n"
        "from forge_rl.envs import EnvConfig, env_factory\n"
        "from forge_rl.envs.openenv_config import OpenEnvConfig\n"
        f"cfg = EnvConfig(openenv=OpenEnvConfig(env='{ENVS}:RecordedAddition', serve=True, action_field='answer'))\n"
        "f = env_factory(cfg, types.SimpleNamespace(seed=0, rollout_tasks=1, group_size=1, output_dir=None))\n"
        "print(f.server.proc.pid, f.server.url, flush=True)\n"
        "time.sleep(600)\n"
    )
    controller = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    pid, url = controller.stdout.readline().split()
    controller.kill()  # SIGKILL: nothing of it runs to stop the server
    controller.wait()
    assert gone(int(pid), port_of(url))


@pytest.mark.parametrize("how", ["ends", "ctrl-c"])
def test_a_run_trains_through_its_server_and_leaves_nothing_when_it_ends_or_is_interrupted(tmp_path, how):
    """The demo's config (configs/grpo/tiny_openenv.yaml), two steps: the groups reach the trainer through the
    server; after the run, or a SIGINT once it trains, no server process and no port are left."""
    app = subprocess.Popen(
        [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo/tiny_openenv.yaml"]
        + [f"output_dir={tmp_path}", f"steps={2 if how == 'ends' else 50}", "rollout_tasks=4"]
        + ["eval_every=0", "eval_size=8"],  # the config's 500 held-out episodes, twice, would be most of the run
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=started_in_the_background,
    )
    lines, server, port = [], None, None
    for line in app.stdout:
        lines.append(line)
        server = server or next(iter(servers_of(app.pid)), None)
        if server is not None and port is None:
            port = next((c.laddr.port for c in listening(server)), None)
        if line.startswith("step    1") and how == "ctrl-c":
            app.send_signal(signal.SIGINT)
    code = app.wait(timeout=300)
    output = "".join(lines)
    assert server is not None and port is not None, output
    assert (code == 0) if how == "ends" else (code != 0 and "step    2" not in output), output
    assert "step    1" in output and "dropped group" not in output, output
    assert gone(server.pid, port), f"the OpenEnv server outlived the run ({how})"
