"""The run's OpenAI-compatible endpoint: /v1/chat/completions, /v1/completions and /v1/models on a loopback port,
served from the controller's event loop and backed by the run's generator replicas (`generator.generate.route`, so
routing, admission and weight swaps work as for the built-in rollouts).

    server = AgentServer(tokenizer, generator, settings)
    await server.start()                              # uvicorn in this event loop, on agent.port (0: a free one)
    record = server.open_episode(example, trained=True)
    server.base_url(record), record.key               # http://127.0.0.1:PORT/episodes/<id>/v1, its bearer key
    ...                                               # an agent's openai client calls it
    server.close_episode(record)
    await server.stop()                               # the port released, nothing left running

Each episode has its own base URL, under which every call is recorded (forge_rl/agents/episodes.py) and checked
against the run's sampling (forge_rl/agents/requests.py). The request and response bodies are vLLM's own models of
the OpenAI API, and tool calls in a reply are parsed by the parser vLLM ships for Hermes-style calls (Qwen3's); the
tokens come from the generator, never from vLLM's server. The root base URL (http://127.0.0.1:PORT/v1) serves the
same model unrecorded and never trained on (a smoke test, a benchmark); a call to an episode that does not exist,
or has ended, is refused (404). A client that cannot take a URL per episode (one connection pool shared by many
episodes, as verifiers' interception server keeps one per endpoint URL) calls the root URL and names its episode in
the request's model instead: `<model>@episode/<id>` (`episode_model`).

Every call carries a bearer key: an episode's URL takes only that episode's key (`EpisodeRecord.key`), the root URL
the run's (`run_key`); a call without its key is refused (401) and never recorded (forge_rl/agents/access.py).
"""

import asyncio
import contextlib
import itertools
import socket
import time
from dataclasses import dataclass, field

from forge_rl.agents.access import Unauthorised, admitted, episode_key, refusal, run_key
from forge_rl.agents.conversation import ChatContinuation, template_message
from forge_rl.agents.episodes import EpisodeRecord, Plan, Refused, assistant_message, reply_of
from forge_rl.agents.images import ImageParts
from forge_rl.agents.requests import generate_options, max_tokens, refuse
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


@dataclass
class EndpointSettings:
    """What the endpoint takes from the run: its sampling, limits and model name."""

    model_name: str
    sampling: dict  # generator.sampling: the run's behaviour policy
    max_model_len: int
    non_prefix: str = "split"
    port: int = 0
    tool_parser: str | None = "hermes"
    chat_template_kwargs: dict = field(default_factory=dict)

    @property
    def max_tokens(self) -> int:
        return int(self.sampling.get("max_tokens", 16))


@dataclass
class EndpointStats:
    """Counts since the start: calls, non-prefix splits, forks, refusals; and seconds spent outside generation."""

    calls: int = 0
    refused: int = 0
    unauthorised: int = 0  # calls without their key (401), never read into an episode
    total_s: float = 0.0  # answering calls, generation included
    generate_s: float = 0.0  # waiting for the generators

    @property
    def overhead_s(self) -> float:
        """Seconds the endpoint spent on calls besides generation: parsing, rendering, recording, responding."""
        return self.total_s - self.generate_s


class AgentServer:
    """The endpoint of one run: its episodes, its uvicorn server, and what it counted."""

    def __init__(self, tokenizer, generator, settings: EndpointSettings):
        from forge_rl.deps.vllm import openai_protocol

        self.tokenizer, self.generator, self.settings = tokenizer, generator, settings
        self.protocol = openai_protocol()
        self.chat = ChatContinuation(tokenizer, **settings.chat_template_kwargs)
        self.eos_ids = {tokenizer.eos_token_id} - {None}
        self.images = ImageParts(tokenizer)  # image_url parts, for a vision-language model (agents/images.py)
        self.episodes: dict[str, EpisodeRecord] = {}
        self.stats = EndpointStats()
        self.port: int | None = None
        self.run_key = run_key()  # the root URL's key: it stays in the run's process
        self._ids = itertools.count()
        self._server = self._task = self._socket = None

    # ---- episodes ---------------------------------------------------------------------------------------------

    def open_episode(self, example, trained: bool) -> EpisodeRecord:
        episode_id = f"{'t' if trained else 'e'}{next(self._ids)}"
        record = EpisodeRecord(
            episode_id, example, trained, self.settings.non_prefix, self.chat, episode_key(episode_id)
        )
        self.episodes[episode_id] = record
        return record

    def close_episode(self, record: EpisodeRecord) -> None:
        record.closed = True
        self.episodes.pop(record.id, None)

    def base_url(self, record: EpisodeRecord | None = None) -> str:
        root = f"http://127.0.0.1:{self.port}"
        return f"{root}/v1" if record is None else f"{root}/episodes/{record.id}/v1"

    def _admitted(self, headers, url_episode: str | None, model_episode: str | None = None) -> EpisodeRecord | None:
        """The episode a call is of (None: the root URL's, unrecorded), once its key is the one it takes:
        UnknownEpisode for an episode that is not open, Unauthorised for a call without its key."""
        record = self._episode(url_episode or model_episode)
        # an episode's URL takes its key; the root URL the run's, or the key of the episode its model names
        keys = [self.run_key] if record is None else [record.key] + ([self.run_key] if not url_episode else [])
        if admitted(headers.get("authorization"), keys):
            return record
        self.stats.unauthorised += 1
        raise refusal(None if record is None else record.id)

    def _episode(self, episode_id: str | None) -> EpisodeRecord | None:
        if episode_id is None:
            return None
        if (record := self.episodes.get(episode_id)) is None:
            raise UnknownEpisode(
                f"no open episode {episode_id!r} on this endpoint: call the base URL the episode's client was given "
                "(an episode ends when its agent returns or times out)"
            )
        return record

    # ---- start and stop ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve on 127.0.0.1 (agent.port, or a free port) from this event loop."""
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind(("127.0.0.1", self.settings.port))
        except OSError as e:
            self._socket.close()
            raise ConfigError(
                f"agent.port={self.settings.port}: cannot listen on 127.0.0.1 ({e}); use 0 for a free port"
            ) from None
        self.port = self._socket.getsockname()[1]
        # an episode's client keeps its connection between calls, however long the agent takes in between: closed by
        # uvicorn's default 5 s keep-alive, a connection can be closed just as the client reuses it (a connection
        # error on a busy machine)
        config = uvicorn.Config(
            self._app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._server = _ServerWithoutSignals(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():  # it failed to start: its error
                await self._task
            await asyncio.sleep(0.02)

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
        for record in list(self.episodes.values()):
            self.close_episode(record)

    def _app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI(title="forge_rl agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        answer = self._answer  # each route's call: admitted, served, its failure answered
        for prefix, episode in (("/v1", None), ("/episodes/{episode_id}/v1", "episode_id")):

            def routes(prefix=prefix, episode=episode):
                @app.post(f"{prefix}/chat/completions")
                async def chat(request: Request, episode_id: str | None = None):
                    return await answer(episode_id if episode else None, request, self.chat_completion)

                @app.post(f"{prefix}/completions")
                async def completions(request: Request, episode_id: str | None = None):
                    return await answer(episode_id if episode else None, request, self.completion)

                @app.get(f"{prefix}/models")
                async def models(request: Request, episode_id: str | None = None):
                    try:
                        self._admitted(request.headers, episode_id if episode else None)
                    except UnknownEpisode as e:
                        return self._error(str(e), "NotFoundError", 404)
                    except Unauthorised as e:
                        return self._error(str(e), "AuthenticationError", 401)
                    return JSONResponse(self.models().model_dump(exclude_none=True))

            routes()
        return app

    async def _answer(self, episode_id: str | None, request, serve):
        """A POST's response: the call admitted (its episode open, its key the one it takes), served, and each
        failure as the OpenAI API answers it (404, 401, 400, 500)."""
        from fastapi.responses import JSONResponse

        try:
            # an episode URL's key is checked before its body is read; the root URL's once the body says whether
            # the call names an episode in its model (a shared client's)
            record = self._admitted(request.headers, episode_id) if episode_id else None
            body = await request.json()
            if episode_id is None:
                episode_id = episode_of_model(body.get("model")) if isinstance(body, dict) else None
                record = self._admitted(request.headers, None, episode_id)
            return JSONResponse((await serve(record, body)).model_dump(exclude_none=True))
        except UnknownEpisode as e:
            return self._error(str(e), "NotFoundError", 404)
        except Unauthorised as e:  # before anything of the call is read into its episode
            return self._error(str(e), "AuthenticationError", 401)
        except Refused as e:
            return self._error(str(e), "BadRequestError", 400)
        except (SupervisionError, asyncio.CancelledError):
            raise
        except ValueError as e:  # a body that is not JSON, or not the request's schema (pydantic says which field)
            return self._error(" ".join(str(e).split())[:500], "BadRequestError", 400)
        except _GenerationFailed as e:
            return self._error(str(e), "InternalServerError", 500)
        except Exception as e:  # a bug of the endpoint's: the episode fails, the run goes on
            message = f"the endpoint failed on this call: {type(e).__name__}: {e}".splitlines()[0][:300]
            if episode_id is not None and episode_id in self.episodes:
                self.episodes[episode_id].fail("endpoint_error", message)
            return self._error(message, "InternalServerError", 500)

    def _error(self, message: str, kind: str, code: int):
        from fastapi.responses import JSONResponse

        p = self.protocol
        body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=kind, code=code))
        headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
        return JSONResponse(body.model_dump(exclude_none=True), status_code=code, headers=headers)

    # ---- the endpoints ----------------------------------------------------------------------------------------

    def models(self):
        p = self.protocol
        card = p.ModelCard(id=self.settings.model_name, owned_by="forge_rl", max_model_len=self.settings.max_model_len)
        return p.ModelList(data=[card])

    async def chat_completion(self, record: EpisodeRecord | None, body: dict):
        """/v1/chat/completions: the conversation continued on the episode's recorded tokens, sampled, recorded."""
        p, started = self.protocol, time.perf_counter()
        request = p.ChatCompletionRequest.model_validate(body)
        options = self._checked(record, lambda: self._chat_options(record, request))
        sent, images = self._checked(record, lambda: self.images.take(request.messages))
        messages = self._checked(record, lambda: [template_message(m, f"messages[{i}]") for i, m in enumerate(sent)])
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        kwargs = request.chat_template_kwargs or {}
        plan = self._checked(
            record,
            lambda: (
                record.plan_chat(messages, tools, kwargs)
                if record
                else Plan(self.chat.prompt_ids(messages, tools, kwargs))
            ),
        )
        asked = request.max_completion_tokens or request.max_tokens
        generate = {**options, "images": images} if images else options
        completions = await self._generate(record, plan.prompt_ids, request.n or 1, asked, generate)
        replies, choices = zip(*(self.chat_choice(i, c, request, options) for i, c in enumerate(completions)))
        if record is not None:
            record.record(plan, list(replies), "chat", messages)
        response = p.ChatCompletionResponse(
            model=self.settings.model_name,
            choices=list(choices),
            usage=self._usage(plan.prompt_ids, completions),
            prompt_token_ids=plan.prompt_ids if request.return_token_ids else None,
        )
        self._count(started)
        return response

    async def completion(self, record: EpisodeRecord | None, body: dict):
        """/v1/completions: a text (or token ids) prompt, continued on the episode's recorded tokens when it starts
        with an earlier call's prompt and the text it got."""
        p, started = self.protocol, time.perf_counter()
        request = p.CompletionRequest.model_validate(body)
        options = self._checked(record, lambda: self._completion_options(record, request))
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            self._checked(record, lambda: refuse("prompt: one prompt per call (a string or token ids), not a batch"))
        plan = self._checked(
            record,
            lambda: (
                record.plan_text(prompt, self.tokenizer)
                if record
                else Plan(
                    list(prompt)
                    if isinstance(prompt, list)
                    else self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                )
            ),
        )
        completions = await self._generate(record, plan.prompt_ids, request.n or 1, request.max_tokens, options)
        replies, choices = [], []
        for i, c in enumerate(completions):
            text = self._text(c, options, request.skip_special_tokens, request.include_stop_str_in_output)
            replies.append(reply_of(c, self.tokenizer, self.eos_ids, None, text))
            logprobs = None
            if request.logprobs is not None:
                tokens = [self.tokenizer.decode([t]) for t in c.response_ids.tolist()]
                logprobs = p.CompletionLogProbs(tokens=tokens, token_logprobs=c.logprobs.tolist())
            choices.append(
                p.CompletionResponseChoice(
                    index=i,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    token_ids=c.response_ids.tolist() if request.return_token_ids else None,
                    prompt_token_ids=plan.prompt_ids if request.return_token_ids else None,
                )
            )
        if record is not None:
            record.record(plan, replies, "text", prompt if isinstance(prompt, str) else None)
        response = p.CompletionResponse(
            model=self.settings.model_name, choices=choices, usage=self._usage(plan.prompt_ids, completions)
        )
        self._count(started)
        return response

    # ---- their parts --------------------------------------------------------------------------------------------

    def chat_choice(self, index: int, c, request, options: dict) -> tuple:
        """One choice of a chat call: what the episode records of it (Reply) and what the agent gets: the reply's
        text, its tool calls parsed into OpenAI tool_calls when the request has tools, its logprobs if asked."""
        p = self.protocol
        parse = bool(request.tools) and request.tool_choice != "none" and self.settings.tool_parser is not None
        text = self._text(c, options, request.skip_special_tokens and not parse, request.include_stop_str_in_output)
        content, calls = self._tool_calls(text, request) if parse else (text, [])
        message = assistant_message(content, [t.model_dump() for t in calls])
        choice = p.ChatCompletionResponseChoice(
            index=index,
            message=p.ChatMessage(role="assistant", content=content, tool_calls=calls),
            logprobs=p.ChatCompletionLogProbs(content=self._chat_logprobs(c)) if request.logprobs else None,
            finish_reason="tool_calls" if calls else c.finish_reason,
            token_ids=c.response_ids.tolist() if request.return_token_ids else None,
        )
        return reply_of(c, self.tokenizer, self.eos_ids, message, content or ""), choice

    def _mode(self, record: EpisodeRecord | None) -> str:
        return "free" if record is None else ("train" if record.trained else "eval")

    def _chat_options(self, record, request) -> dict:
        if request.top_logprobs:
            refuse(f"top_logprobs={request.top_logprobs}: only the sampled token's logprob is recorded; ask for 0")
        if request.tool_choice not in (None, "none", "auto"):
            refuse(f"tool_choice={request.tool_choice!r} is not served (it constrains sampling); use 'auto' or 'none'")
        return generate_options(request, self.settings.sampling, self._mode(record))

    def _completion_options(self, record, request) -> dict:
        if request.logprobs is not None and request.logprobs > 1:
            refuse(f"logprobs={request.logprobs}: only the sampled token's logprob is recorded; ask for 0 or 1")
        if request.suffix:
            refuse("suffix is not served")
        return generate_options(request, self.settings.sampling, self._mode(record))

    def _checked(self, record: EpisodeRecord | None, step):
        """`step()`, a refusal of it recorded as the episode's failure (its group is dropped, the reason counted)."""
        try:
            return step()
        except Refused as e:
            if record is not None:
                record.fail(e.reason, str(e))
            self.stats.refused += 1
            raise
        except Exception as e:  # a message the template cannot take (a ValueError, or the template's own error)
            self.stats.refused += 1
            if record is not None:
                record.fail("agent_request", str(e))
            raise Refused("agent_request", str(e)) from None

    async def _generate(self, record, prompt_ids: list[int], n: int, asked: int | None, options: dict) -> list:
        from forge_rl.actors.generator import PromptTooLong

        s = self.settings
        budget = self._checked(record, lambda: max_tokens(asked, s.max_tokens, len(prompt_ids), s.max_model_len))
        started = time.perf_counter()
        try:
            completions = await self.generator.generate.route(prompt_ids, n=n, max_tokens=budget, **options)
        except (Exception, SupervisionError) as e:
            failure = getattr(e, "exception", e)
            if isinstance(failure, PromptTooLong):
                self._checked(record, lambda: _raise(Refused("prompt_too_long", str(failure))))
            message = f"generation failed: {type(failure).__name__}: {failure}".splitlines()[0][:300]
            if record is not None:
                record.fail("generation_error", message)
            raise _GenerationFailed(message) from None
        finally:
            self.stats.generate_s += time.perf_counter() - started
        return completions

    def _text(self, c, options: dict, skip_special: bool, include_stop: bool) -> str:
        """A reply's text: its tokens decoded (the end-of-turn token left out), cut at a stop string it ends on."""
        ids = c.response_ids.tolist()
        if c.finish_reason == "stop" and ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special)
        stops = options.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if c.finish_reason == "stop" and stops and not include_stop:
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        return text

    def _tool_calls(self, text: str, request) -> tuple[str | None, list]:
        """The reply's tool calls as OpenAI tool_calls (vLLM's Hermes parser), and the content before them."""
        from forge_rl.deps.vllm import hermes_tool_parser

        parsed = hermes_tool_parser()(self.tokenizer).extract_tool_calls(text, request)
        if not parsed.tools_called:
            return text, []
        return parsed.content, list(parsed.tool_calls)

    def _chat_logprobs(self, c) -> list:
        p = self.protocol
        out = []
        for token, logprob in zip(c.response_ids.tolist(), c.logprobs.tolist()):
            text = self.tokenizer.decode([token])
            out.append(p.ChatCompletionLogProbsContent(token=text, logprob=logprob, bytes=list(text.encode())))
        return out

    def _usage(self, prompt_ids: list[int], completions: list):
        generated = sum(len(c.response_ids) for c in completions)
        return self.protocol.UsageInfo(
            prompt_tokens=len(prompt_ids), completion_tokens=generated, total_tokens=len(prompt_ids) + generated
        )

    def _count(self, started: float) -> None:
        self.stats.calls += 1
        self.stats.total_s += time.perf_counter() - started


class _GenerationFailed(RuntimeError):
    """The generator failed on a call (the episode's failure is recorded); the server answers 500."""


def _raise(error: Exception):
    raise error


def _server_class():
    import uvicorn

    class ServerWithoutSignals(uvicorn.Server):
        """uvicorn's server without its SIGINT/SIGTERM handlers: the run's own (a final checkpoint) stay in place."""

        def capture_signals(self):
            return contextlib.nullcontext()

    return ServerWithoutSignals


def _ServerWithoutSignals(config):  # noqa: N802 - made like the class it returns, imported only when started
    return _server_class()(config)
