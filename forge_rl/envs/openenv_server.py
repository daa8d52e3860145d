"""The OpenEnv server a run owns (`env.openenv.serve: true`): started once per run, stopped with it.

A run asks for its environment several times (its start-up checks, its rollouts, each evaluation: `env_factory`);
the server is keyed by the run's own `env` config object, so every ask of one run gets the one server and a
second run in the same process (a notebook, a test) gets its own. `stop_server(env_cfg)` (RecipeRun.stop) ends it;
a run object that is dropped without stopping, and the interpreter's exit, end it too. The process runs in a
session of its own and dies with this one (forge_rl/envs/openenv_app.py), so nothing outlives the run, not even
a SIGKILLed one.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from pathlib import Path

from forge_rl.errors import RunStopped

STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL
HEALTH_POLL_S = 0.1


class EnvServer:
    """A uvicorn process serving one environment class (forge_rl/envs/openenv_app.py)."""

    def __init__(self, env: str, args: dict, action: str | None, max_concurrency: int, log_path: Path):
        self.env = env
        self.spec = dict(env=env, args=args, action=action, max_concurrency=max_concurrency, parent=os.getpid())
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self, timeout_s: float) -> str:
        """Start the server and wait until it answers /health; its URL. RunStopped (one line: the class, the
        server's last line of stderr, its log) when it exits or does not answer within `timeout_s`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # the run's server, from its start; the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "forge_rl.envs.openenv_app", json.dumps(self.spec)],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C goes to the run, which stops the server in order
                env={**os.environ, "PYTHONPATH": os.pathsep.join(os.path.abspath(p or ".") for p in sys.path)},
            )
        deadline = time.monotonic() + timeout_s
        port = self._read_port(deadline)
        self.url = f"http://127.0.0.1:{port}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail("exited")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self.url
            except OSError:
                time.sleep(HEALTH_POLL_S)
        self._fail(f"did not answer /health within {timeout_s:.0f} s (env.openenv.start_timeout_s)")

    def _read_port(self, deadline: float) -> int:
        out = self.proc.stdout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
            if ready:
                line = out.readline().strip()
                if line.isdigit():
                    return int(line)
                self._fail("exited before it listened")
            if self.proc.poll() is not None:
                self._fail("exited before it listened")
        self._fail("did not listen within env.openenv.start_timeout_s")

    def last_error_line(self) -> str:
        """The server's last non-empty line of stderr (its log), or a note that it wrote none."""
        try:
            lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            lines = []
        return lines[-1][:300] if lines else "it wrote nothing to stderr"

    def down(self) -> str | None:
        """Why the server is gone (its exit status and last stderr line), or None while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"the OpenEnv server of {self.env} exited (status {self.proc.returncode}): {self.last_error_line()}"

    def _fail(self, what: str) -> None:
        self.stop()
        status = f" (status {self.proc.returncode})" if self.proc and self.proc.returncode is not None else ""
        raise RunStopped(
            f"env.openenv: the server for {self.env} {what}{status}: {self.last_error_line()} (log: {self.log_path})"
        )

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after STOP_GRACE_S; idempotent."""
        proc = self.proc
        if proc is None or proc.returncode is not None and proc.stdout.closed:
            return
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the environment started in the server's group
        except ProcessLookupError:
            pass
        proc.wait()
        proc.stdout.close()


_SERVERS: dict[int, EnvServer] = {}  # id(a run's EnvConfig) -> its server


def server_for(env_cfg, max_concurrency: int, output_dir: str | None) -> EnvServer:
    """The run's server for `env_cfg` (its env config object), started on the first ask."""
    key = id(env_cfg)
    if key in _SERVERS:
        return _SERVERS[key]
    section = env_cfg.openenv
    log_dir = Path(output_dir) / "logs" if output_dir else Path(tempfile.gettempdir())
    log_path = log_dir / ("openenv_server.log" if output_dir else f"forge_rl_openenv_{os.getpid()}_{key}.log")
    server = EnvServer(section.env, dict(section.args), section.action, max_concurrency, log_path)
    _SERVERS[key] = server
    weakref.finalize(env_cfg, stop_key, key)  # a run dropped without stop() still ends its server
    try:
        server.start(section.start_timeout_s)
    except BaseException:
        _SERVERS.pop(key, None)
        raise
    return server


def stop_key(key: int) -> None:
    server = _SERVERS.pop(key, None)
    if server is not None:
        server.stop()


def stop_server(env_cfg) -> None:
    """Stop the server the run of `env_cfg` started, if any (RecipeRun.stop calls it; idempotent)."""
    stop_key(id(env_cfg))


def running_servers() -> list[EnvServer]:
    return list(_SERVERS.values())


@atexit.register
def _stop_all() -> None:
    for key in list(_SERVERS):
        stop_key(key)
