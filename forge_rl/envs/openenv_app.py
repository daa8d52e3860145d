"""The server process a run starts for `env.openenv.serve: true`: the environment's class served by OpenEnv's own
app (`create_fastapi_app`) under uvicorn, on a free loopback port, until the run stops it.

    python -m forge_rl.envs.openenv_app '{"env": "pkg.module:Class", "args": {}, "action": null,
                                          "max_concurrency": 136, "parent": 1234}'

It binds the port itself (port 0: the kernel picks a free one, no race with another process) and prints it as
its first line of output. It dies with the run's process (`die_with_parent`: even a SIGKILLed run takes it
along), and runs in a session of its own, so a terminal's Ctrl-C reaches the run, which stops it in order.
Also where the environment's classes are resolved, for the server and the run alike.
"""

import functools
import importlib
import inspect
import json
import logging
import socket
import sys
import typing

from openenv.core.env_server import Action, Observation, create_fastapi_app
from openenv.core.env_server import Environment as OpenEnvEnvironment
from starlette.websockets import WebSocketDisconnect

from forge_rl.launch.signals import die_with_parent

HOST = "127.0.0.1"


def import_path(path: str, key: str) -> typing.Any:
    """The object "package.module:Name" names; a ValueError naming `key` when it does not import."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}={path!r}: cannot import it ({type(e).__name__}: {e})") from None


def environment_class(path: str) -> type:
    """The openenv Environment subclass `path` names (env.openenv.env)."""
    cls = import_path(path, "env.openenv.env")
    if not (inspect.isclass(cls) and issubclass(cls, OpenEnvEnvironment)):
        raise ValueError(
            f"env.openenv.env={path!r} is not an OpenEnv Environment (a subclass of "
            "openenv.core.env_server.Environment with reset and step)"
        )
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise ValueError(f"env.openenv.env={path!r} does not implement {missing} (abstract methods of Environment)")
    return cls


def _annotation(fn, name: str, base: type) -> type | None:
    try:
        hint = typing.get_type_hints(fn).get(name)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: fall back to the base class
        return None
    return hint if inspect.isclass(hint) and issubclass(hint, base) else None


def action_class(cls: type, path: str | None) -> type:
    """The environment's Action class: env.openenv.action, else the annotation of its step's `action`."""
    if path is not None:
        action = import_path(path, "env.openenv.action")
        if not (inspect.isclass(action) and issubclass(action, Action)):
            raise ValueError(f"env.openenv.action={path!r} is not an openenv Action subclass")
        return action
    found = _annotation(cls.step, "action", Action)
    if found is None:
        raise ValueError(
            f"env.openenv.env: {cls.__name__}.step does not annotate its action with an Action subclass; "
            "name it in env.openenv.action ('package.module:Class')"
        )
    return found


def observation_class(cls: type) -> type:
    """The Observation class the environment's step returns (its annotation), for the server's schema."""
    return _annotation(cls.step, "return", Observation) or Observation


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen(2048)
    return sock


class ClosedSessionNoise(logging.Filter):
    """Drops the traceback uvicorn logs when openenv's /ws handler closes a WebSocket the client has already
    closed (every episode ends so): harmless, and one per episode would fill the server's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], WebSocketDisconnect))


def main(spec: dict) -> None:
    die_with_parent(spec["parent"])
    import uvicorn  # openenv's server runs under it (an openenv-core dependency)

    cls = environment_class(spec["env"])
    factory = functools.partial(cls, **spec["args"]) if spec["args"] else cls
    app = create_fastapi_app(
        factory, action_class(cls, spec["action"]), observation_class(cls), max_concurrent_envs=spec["max_concurrency"]
    )
    sock = _listening_socket()
    print(sock.getsockname()[1], flush=True)  # the run reads the port from this first line
    config = uvicorn.Config(app, log_level="warning", ws_max_size=100 << 20, timeout_graceful_shutdown=2)
    logging.getLogger("uvicorn.error").addFilter(ClosedSessionNoise())  # after Config, which sets up logging
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
