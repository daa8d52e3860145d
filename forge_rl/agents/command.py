"""Any program as an agent: `agent.command: [program, arg, ...]` runs once per episode, in a process of its own.

    OPENAI_BASE_URL=http://127.0.0.1:PORT/episodes/<id>/v1  OPENAI_API_KEY=forge-rl-episode-<id>-...  program args
    stdin:  the task row as JSON: {"id", "prompt", "messages", "answer", "columns"} (forge_rl.data.task.TaskExample)
    stdout: its last line is the episode's reward as JSON: a number, or {"reward": number}; nothing (or null):
            the run's rewards score the episode's last reply

Any language, any client library (or none: examples/agents/http_agent.py speaks HTTP with the standard library),
a CLI scaffold, a container's entry point: the OpenAI variables are the ones the openai SDKs read, and name the
episode (its URL and its own key, forge_rl/agents/access.py); the run's key is never in the program's environment.
Its stderr goes to the run's logs (agent_command.log beside the role processes' logs; the controller's stderr with
--verbose), each line after its episode's id.

Limits, each failure one line that drops the episode's group (forge_rl/agents/rollout.py): agent.episode_timeout_s
(`agent_timeout`), a non-zero exit status (`agent_error`, with its last stderr line), more than
agent.max_output_bytes on stdout (`agent_output`), a last line that is not a reward in JSON (`agent_reward`). The
program runs in a session of its own, which is killed when its episode ends however it ends, so nothing it started
outlives its episode.
"""

import asyncio
import json
import math
import os
import shlex
import signal
import sys
from pathlib import Path

from forge_rl.agents.entry import EpisodeFailed
from forge_rl.agents.verifiers_env import API_KEY_VAR

LOG_NAME = "agent_command.log"
STDERR_LINE = 2000  # characters of a stderr line kept in the log
CHUNK = 65536


def command_line(command: list[str]) -> str:
    """The command as one short line, for messages (a program given as code keeps to one line, and the line room
    for the failure's cause)."""
    line = shlex.join(command).replace("\n", "\\n")
    return line if len(line) <= 60 else line[:57] + "..."


def row_json(example) -> bytes:
    """The task row a program reads on stdin (values JSON cannot hold as they are, as their text)."""
    row = {
        "id": example.id,
        "prompt": example.prompt,
        "messages": example.messages,
        "answer": example.answer,
        "columns": example.columns,
    }
    return (json.dumps(row, default=str) + "\n").encode()


def program_env(base_url: str, api_key: str) -> dict[str, str]:
    """The program's environment: the run's own, its episode's OpenAI variables, and not the run's key."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_VAR}
    return {**env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}


def parse_reward(stdout: bytes, name: str) -> float | None:
    """The reward the last line of `stdout` gives (None: none given), or EpisodeFailed (agent_reward)."""
    lines = [line.strip() for line in stdout.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return None
    how = 'print the reward as JSON (a number, or {"reward": 1.0}) last, or nothing for the run\'s rewards to score it'
    try:
        value = json.loads(lines[-1])
    except ValueError:
        raise EpisodeFailed(
            "agent_reward", f"{name} printed {lines[-1]!r:.100} last on stdout, not JSON: {how}"
        ) from None
    if isinstance(value, dict):
        value = value.get("reward")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EpisodeFailed("agent_reward", f"{name} printed {lines[-1]!r:.100} last on stdout: {how}")
    return float(value)


async def read_capped(stream, cap: int) -> tuple[bytes, bool]:
    """What `stream` gives until its end, at most `cap` bytes; True when it gave more."""
    data = bytearray()
    while chunk := await stream.read(CHUNK):
        data += chunk
        if len(data) > cap:
            return bytes(data[:cap]), True
    return bytes(data), False


def run_log_dir() -> Path | None:
    """The running run's log folder (output_dir/logs), or None (--verbose, or no run): the provisioner's, read
    without starting one."""
    from forge_rl.runtime.provisioner import running_provisioner

    current = running_provisioner()
    return None if current is None else current.log_dir


class CommandAgent:
    """fn(example, client) of agent.command for AgentEntry: one program per episode, with the client's URL and key;
    its reward, or None, or EpisodeFailed. Cancelled (the episode's time limit), it kills the program's session."""

    def __init__(self, command: list[str], max_output_bytes: int, log_dir: str | None = None):
        self.command, self.max_output_bytes = list(command), max_output_bytes
        self.log_dir = log_dir  # where its stderr goes (an agent worker's run); None: the running run's log folder
        self.name = f"agent command {command_line(command)}"
        self._log = None

    async def __call__(self, example, client) -> float | None:
        base_url = str(client.base_url).rstrip("/")
        episode = base_url.rsplit("/episodes/", 1)[-1].split("/", 1)[0]
        process = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=program_env(base_url, client.api_key),
            start_new_session=True,  # its own process group: everything it starts ends with it
        )
        last_stderr: list[str] = []
        tasks = [
            asyncio.ensure_future(self._feed(process, row_json(example))),
            asyncio.ensure_future(self._stderr(process.stderr, episode, last_stderr)),
        ]
        try:
            stdout, flooded = await read_capped(process.stdout, self.max_output_bytes)
            if flooded:
                raise EpisodeFailed(
                    "agent_output",
                    f"{self.name} printed more than agent.max_output_bytes={self.max_output_bytes} bytes on stdout "
                    "(stopped): print only the reward there, and logs on stderr",
                )
            status = await process.wait()
            await asyncio.wait(tasks, timeout=5)  # its stderr read to the end, for the line below
            if status != 0:
                said = f"; its last stderr line: {last_stderr[0]}" if last_stderr else " and printed nothing on stderr"
                raise EpisodeFailed("agent_error", f"{self.name} exited with status {status}{said}"[:400])
            return parse_reward(stdout, self.name)
        finally:
            _kill_session(process)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await process.wait()

    async def _feed(self, process, row: bytes) -> None:
        """The row on the program's stdin, then its end (a program that does not read it is no failure)."""
        try:
            process.stdin.write(row)
            await process.stdin.drain()
            process.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass

    async def _stderr(self, stream, episode: str, last: list[str]) -> None:
        """Each stderr line to the run's log after the episode's id, the last one kept for a failure's line; at
        most max_output_bytes of it logged."""
        logged = 0
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip("\n")[:STDERR_LINE]
            if text.strip():
                last[:] = [text.strip()[:300]]
            if logged <= self.max_output_bytes:
                logged += len(line)
                self._write(f"{episode}: {text}" if logged <= self.max_output_bytes else f"{episode}: (more cut)")

    def _write(self, line: str) -> None:
        if self._log is None:
            folder = Path(self.log_dir) if self.log_dir is not None else run_log_dir()
            self._log = open(folder / LOG_NAME, "a", buffering=1) if folder is not None else sys.stderr  # noqa: SIM115
        print(line, file=self._log)

    async def close(self) -> None:
        """The log file, if one was opened."""
        log, self._log = self._log, None
        if log is not None and log is not sys.stderr:
            log.close()


def _kill_session(process) -> None:
    """SIGKILL to the program's process group (it and what it started), if any of it is left."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
