"""The HTTP side of the Tinker protocol, as the `tinker` client (0.38) speaks it: the session's start-up calls
(client config, session, heartbeats, telemetry), the model and sampling calls (each a future the client polls with
`retrieve_future`), and one line for what is not served.

Every call carries the run's key in `X-API-Key`, compared in constant time; a wrong key is answered 401, which the
client raises as its AuthenticationError. Bodies are the client's JSON (read with its own pydantic types) except
forward_backward's request and the sample and forward_backward results, which are protobuf (forge_rl/tinker/wire.py).
"""

import secrets
import uuid

from forge_rl.tinker.errors import NotServed, Refused
from forge_rl.tinker.futures import Futures
from forge_rl.tinker.wire import read_forward_backward

# What this service asks of the client: API keys (no JWT exchange), plain JSON polling, and the client's default
# HTTP transport (pyqwest, which costs the client less per request than httpx's own: the cookbook sends a request per
# sampled answer).
CLIENT_CONFIG = dict(
    pjwt_auth_enabled=False,
    credential_default_source="api_key",
    use_pyqwest_transport=True,
    proto_compress_fwdbwd=False,
    sample_use_retrieve_futures=False,
    custom_loss_server_side=False,
    sample_join_sampling_session=False,
)
PROTO = "application/x-protobuf"


def owner_of(keys: dict[str, str], presented: str | None) -> str | None:
    """The user whose key was presented, each key compared in constant time; None for a wrong or missing key."""
    found = None
    for key, owner in keys.items():
        if secrets.compare_digest(key.encode(), (presented or "").encode()):
            found = owner
    return found


class KeyCheck:
    """ASGI middleware: a request without a known key in `X-API-Key` is answered 401; otherwise its user is
    `request.state.owner`. Plain ASGI rather than Starlette's BaseHTTPMiddleware, which runs every request in a task
    of its own and streams the response through it: the cookbook sends two requests per sampled answer."""

    def __init__(self, app, keys: dict[str, str]):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        presented = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-api-key"), None)
        owner = owner_of(self.keys, presented)
        if owner is None:
            from fastapi.responses import JSONResponse

            detail = "invalid API key: pass the key this forge_rl Tinker service printed at start"
            return await JSONResponse({"detail": detail}, 401)(scope, receive, send)
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)


def make_app(backend, keys: dict[str, str]):
    """The FastAPI app of the service: `backend` runs the calls (forge_rl/tinker/service.py), `keys` maps each
    API key to its user."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="forge_rl Tinker service")
    futures = Futures()
    app.state.futures = futures

    app.add_middleware(KeyCheck, keys=keys)

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused):
        return JSONResponse({"detail": str(error)}, 404 if isinstance(error, NotServed) else 400)

    _session_routes(app, backend)
    _future_routes(app, futures)
    _model_routes(app, backend, futures)
    _sampling_routes(app, backend, futures)
    _state_routes(app, backend, futures)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def not_served(path: str):
        raise NotServed(f"/{path}", "docs/tinker.md lists the calls it serves")

    return app


def _session_routes(app, backend) -> None:
    from fastapi import Request

    @app.post("/api/v1/client/config")
    async def client_config():
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config():
        return {}

    @app.get("/api/v1/healthz")
    async def health():
        return {"status": "ok", **backend.health()}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        backend.sessions.touch(request.state.owner, session_id)
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        backend.sessions.touch(request.state.owner, (await request.json()).get("session_id", ""))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        await backend.sessions.finish(request.state.owner, session_id)
        return None


def _future_routes(app, futures: Futures) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request):
        request_id = (await request.json()).get("request_id", "")
        outcome = await futures.retrieve(request.state.owner, request_id)
        if outcome.pending:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if outcome.error is not None:
            return {"error": outcome.error, "category": "user" if outcome.user_error else "server"}
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTO)
        return JSONResponse(outcome.json)

    @app.post("/api/v1/cancel_future")
    async def cancel(request: Request):
        futures.cancel(request.state.owner, (await request.json()).get("request_id", ""))
        return None


def _model_routes(app, backend, futures: Futures) -> None:
    from fastapi import Request
    from tinker import types

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return backend.capabilities()

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = _parsed(types.CreateModelRequest, await request.json())
        rank = body.lora_config.rank if body.lora_config else None
        seed = body.lora_config.seed if body.lora_config else None
        model_id = f"{body.session_id}:train:{body.model_seq_id}"  # what the client calls it when it loads a state
        work = backend.training.create(request.state.owner, model_id, body.base_model, rank, seed)
        return {"request_id": futures.submit(request.state.owner, work)}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        model = backend.training.model(request.state.owner, (await request.json()).get("model_id", ""))
        return backend.info(model.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        call = read_forward_backward(await request.body())
        work = backend.training.forward_backward(request.state.owner, call)
        return {"request_id": futures.submit(request.state.owner, work), "model_id": call.model_id}

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = await request.json()
        params = body.get("adam_params")
        if params is None:
            raise NotServed("an optimizer other than Adam", "send AdamParams")
        filled = types.AdamParams(**params).model_dump()
        work = backend.training.optim_step(request.state.owner, body.get("model_id", ""), filled)
        return {"request_id": futures.submit(request.state.owner, work), "model_id": body.get("model_id")}

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        body = _parsed(types.SaveWeightsForSamplerRequest, await request.json())
        work = backend.sampling.save(request.state.owner, body.model_id, body.path)
        return {"request_id": futures.submit(request.state.owner, work), "model_id": body.model_id}


def _state_routes(app, backend, futures: Futures) -> None:
    from fastapi import Request
    from tinker import types

    @app.post("/api/v1/save_weights")
    async def save_state(request: Request):
        body = _parsed(types.SaveWeightsRequest, await request.json())
        work = backend.states.save(request.state.owner, body.model_id, body.path, body.overwrite)
        return {"request_id": futures.submit(request.state.owner, work), "model_id": body.model_id}

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str, request: Request):
        return backend.states.listing(request.state.owner, model_id, backend.sampling.paths)

    @app.post("/api/v1/load_weights")
    async def load_state(request: Request):
        body = _parsed(types.LoadWeightsRequest, await request.json())
        new_id = None if body.model_id else f"{body.session_id}:train:{body.model_seq_id}"  # the client's own name
        work = backend.states.load(request.state.owner, body.model_id or new_id, body.path, body.optimizer, new_id)
        return {"request_id": futures.submit(request.state.owner, work), "model_id": body.model_id}


def _sampling_routes(app, backend, futures: Futures) -> None:
    from fastapi import Request
    from tinker import types

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = _parsed(types.CreateSamplingSessionRequest, await request.json())
        sampler_id = backend.sampling.open(request.state.owner, body.model_path, body.base_model)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        sampler = backend.sampling.sampler(request.state.owner, sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": backend.cfg.model, "model_path": sampler.path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        body = _parsed(types.SampleRequest, await request.json())
        if body.sampling_session_id is None:
            raise NotServed("sampling without a sampling session", "create a sampling client first")
        request_id = futures.submit(request.state.owner, backend.sampling.sample(request.state.owner, body))
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}-{i}" for i in range(body.num_samples)]}


def _parsed(model, body: dict):
    """`body` as the client's own request type; one line naming the field that does not fit."""
    import pydantic

    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "the body"
        raise Refused(f"{model.__name__}: {where}: {first.get('msg', 'invalid')}") from None
