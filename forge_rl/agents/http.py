"""The endpoint's HTTP side: the routes of an AgentServer (forge_rl/agents/server.py) as a FastAPI app, each call's
failure answered as the OpenAI API answers it, and the uvicorn server that serves them on a socket of its own.

    listener = Listener()
    port = await listener.start(app(server), "127.0.0.1", 0)   # this event loop; 0: a free port
    ...
    await listener.stop()                                       # the port released, nothing left running

Whichever process the server runs in (a gateway process of its own, forge_rl/agents/gateway.py, or the run's
controller), this is what answers its calls.
"""

import asyncio
import contextlib
import socket

from forge_rl.agents.access import Unauthorised
from forge_rl.agents.episodes import Refused
from forge_rl.deps.monarch import SupervisionError
from forge_rl.errors import ConfigError

KEEP_ALIVE_S = 600


EPISODE_IN_MODEL = "@episode/"  # model "tiny-warm@episode/t12": a root-URL call of episode t12


def episode_model(base_url: str, model: str) -> tuple[str, str]:
    """(the root URL, the model name naming the episode) for a client of the episode whose base URL is `base_url`
    (http://127.0.0.1:PORT/episodes/<id>/v1) that calls the root URL."""
    root, _, rest = str(base_url).partition("/episodes/")
    episode_id = rest.split("/", 1)[0]
    if not episode_id:
        raise ValueError(f"{base_url!r} is not an episode's base URL (http://HOST:PORT/episodes/<id>/v1)")
    return f"{root}/v1", f"{model}{EPISODE_IN_MODEL}{episode_id}"


def episode_of_model(model) -> str | None:
    """The episode a root-URL call's model names (`episode_model`), or None."""
    if isinstance(model, str) and EPISODE_IN_MODEL in model:
        return model.rsplit(EPISODE_IN_MODEL, 1)[1] or None
    return None


class UnknownEpisode(LookupError):
    """A call under an episode URL that names no open episode."""


class GenerationFailed(RuntimeError):
    """The generator failed on a call (the episode's failure is recorded); the server answers 500."""


def app(server):
    """The FastAPI app of `server`: /v1 (the root URL) and /episodes/<id>/v1, each with chat/completions,
    completions and models."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    api = FastAPI(title="forge_rl agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    for prefix, episode in (("/v1", None), ("/episodes/{episode_id}/v1", "episode_id")):

        def routes(prefix=prefix, episode=episode):
            @api.post(f"{prefix}/chat/completions")
            async def chat(request: Request, episode_id: str | None = None):
                return await answer(server, episode_id if episode else None, request, server.chat_completion)

            @api.post(f"{prefix}/completions")
            async def completions(request: Request, episode_id: str | None = None):
                return await answer(server, episode_id if episode else None, request, server.completion)

            @api.get(f"{prefix}/models")
            async def models(request: Request, episode_id: str | None = None):
                try:
                    server.admit(request.headers, episode_id if episode else None)
                except UnknownEpisode as e:
                    return error(server, str(e), "NotFoundError", 404)
                except Unauthorised as e:
                    return error(server, str(e), "AuthenticationError", 401)
                return JSONResponse(server.models().model_dump(exclude_none=True))

        routes()
    return api


async def answer(server, episode_id: str | None, request, serve):
    """A POST's response: the call admitted (its episode open, its key the one it takes), served, and each
    failure as the OpenAI API answers it (404, 401, 400, 500)."""
    from fastapi.responses import JSONResponse

    try:
        # an episode URL's key is checked before its body is read; the root URL's once the body says whether
        # the call names an episode in its model (a shared client's)
        record = server.admit(request.headers, episode_id) if episode_id else None
        body = await request.json()
        if episode_id is None:
            episode_id = episode_of_model(body.get("model")) if isinstance(body, dict) else None
            record = server.admit(request.headers, None, episode_id)
        return JSONResponse((await serve(record, body)).model_dump(exclude_none=True))
    except UnknownEpisode as e:
        return error(server, str(e), "NotFoundError", 404)
    except Unauthorised as e:  # before anything of the call is read into its episode
        return error(server, str(e), "AuthenticationError", 401)
    except Refused as e:
        return error(server, str(e), "BadRequestError", 400)
    except (SupervisionError, asyncio.CancelledError):
        raise
    except ValueError as e:  # a body that is not JSON, or not the request's schema (pydantic says which field)
        return error(server, " ".join(str(e).split())[:500], "BadRequestError", 400)
    except GenerationFailed as e:
        return error(server, str(e), "InternalServerError", 500)
    except Exception as e:  # a bug of the endpoint's: the episode fails, the run goes on
        message = f"the endpoint failed on this call: {type(e).__name__}: {e}".splitlines()[0][:300]
        if episode_id is not None and episode_id in server.episodes:
            server.episodes[episode_id].fail("endpoint_error", message)
        return error(server, message, "InternalServerError", 500)


def error(server, message: str, kind: str, code: int):
    from fastapi.responses import JSONResponse

    p = server.protocol
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=kind, code=code))
    headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
    return JSONResponse(body.model_dump(exclude_none=True), status_code=code, headers=headers)


class Listener:
    """uvicorn serving one app from this event loop on a socket bound here."""

    def __init__(self):
        self._server = self._task = self._socket = None

    async def start(self, api, host: str, port: int) -> int:
        """Serve `api` on host:port (0: a free port); the port bound."""
        import uvicorn

        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on the connections of a socket that names it, and without
        # it a response's body waits for the client's delayed ACK of its headers (40 ms a call on Linux loopback)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as e:
            self._socket.close()
            raise ConfigError(
                f"agent.port={port}, agent.gateway.host={host}: cannot listen there ({e}); use port 0 for a free "
                "port, and an address of this host (0.0.0.0: all of them)"
            ) from None
        # an episode's client keeps its connection between calls, however long the agent takes in between: closed by
        # uvicorn's default 5 s keep-alive, a connection can be closed just as the client reuses it (a connection
        # error on a busy machine)
        config = uvicorn.Config(
            api,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._server = _server_class()(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():  # it failed to start: its error
                await self._task
            await asyncio.sleep(0.02)
        return self._socket.getsockname()[1]

    async def stop(self) -> None:
        """Stop serving (calls in flight get a moment to finish) and release the port (idempotent)."""
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            if not self._task.done():
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
            self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def url_host(host: str) -> str:
    """The host part of the URLs an endpoint bound to `host` gives out: the address itself, or for an address
    that means every interface, this host's name (which the run's other hosts resolve)."""
    return socket.gethostname() if host in ("0.0.0.0", "", "::") else host


def _server_class():
    import uvicorn

    class ServerWithoutSignals(uvicorn.Server):
        """uvicorn's server without its SIGINT/SIGTERM handlers: the run's own (a final checkpoint) stay in place."""

        def capture_signals(self):
            return contextlib.nullcontext()

    return ServerWithoutSignals
