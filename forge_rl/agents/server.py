"""The run's OpenAI-compatible endpoint: /v1/chat/completions, /v1/completions and /v1/models, backed by the run's
generator replicas. It runs in a gateway process of its own (forge_rl/agents/gateway.py, agent.gateway.process:
true, the default) or in the run's controller; its HTTP side is forge_rl/agents/http.py.

    server = AgentServer(tokenizer, generator, settings)
    await server.start()                              # uvicorn in this event loop, on agent.port (0: a free one)
    record = server.open_episode(example, trained=True)
    server.base_url(record), record.key               # http://127.0.0.1:PORT/episodes/<id>/v1, its bearer key
    ...                                               # an agent's openai client calls it
    server.close_episode(record)
    await server.stop()                               # the port released, nothing left running

Each episode has its own base URL, under which every call is recorded (forge_rl/agents/episodes.py) and checked
against the run's sampling (forge_rl/agents/requests.py). Every call of an episode goes to one generator replica
(`generator.generate.route(..., session=<episode id>)`, sticky while that replica lives), so the engine's prefix
cache holds the episode's earlier turns. The request and response bodies are vLLM's own models of the OpenAI API,
and tool calls in a reply are parsed by the parser vLLM ships for Hermes-style calls (Qwen3's); the tokens come
from the generator, never from vLLM's server. The root base URL (http://HOST:PORT/v1) serves the same model
unrecorded and never trained on (a smoke test, a benchmark); a call to an episode that does not exist, or has
ended, is refused (404). A client that cannot take a URL per episode (one connection pool shared by many
episodes, as verifiers' interception server keeps one per endpoint URL) calls the root URL and names its episode in
the request's model instead: `<model>@episode/<id>` (`episode_model`).

Every call carries a bearer key: an episode's URL takes only that episode's key (`EpisodeRecord.key`), the root URL
the run's (`run_key`); a call without its key is refused (401) and never recorded (forge_rl/agents/access.py).
"""

import itertools
import time
from dataclasses import dataclass, field

from forge_rl.agents.access import admitted, episode_key, refusal, run_key
from forge_rl.agents.conversation import ChatContinuation, template_message
from forge_rl.agents.episodes import EpisodeRecord, Plan, Refused, assistant_message, reply_of
from forge_rl.agents.http import (  # noqa: F401 - episode_model, episode_of_model: the endpoint's, for its callers
    GenerationFailed,
    Listener,
    UnknownEpisode,
    app,
    episode_model,
    episode_of_model,
    url_host,
)
from forge_rl.agents.images import ImageParts
from forge_rl.agents.requests import generate_options, max_tokens, refuse
from forge_rl.deps.monarch import SupervisionError


@dataclass
class EndpointSettings:
    """What the endpoint takes from the run: its sampling, limits and model name."""

    model_name: str
    sampling: dict  # generator.sampling: the run's behaviour policy
    max_model_len: int
    non_prefix: str = "split"
    port: int = 0
    host: str = "127.0.0.1"  # the address it listens on (agent.gateway.host); 0.0.0.0: every interface
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

    def __init__(self, tokenizer, generator, settings: EndpointSettings, key: str | None = None, id_prefix: str = ""):
        from forge_rl.deps.vllm import openai_protocol

        self.tokenizer, self.generator, self.settings = tokenizer, generator, settings
        self.protocol = openai_protocol()
        self.chat = ChatContinuation(tokenizer, **settings.chat_template_kwargs)
        self.eos_ids = {tokenizer.eos_token_id} - {None}
        self.images = ImageParts(tokenizer)  # image_url parts, for a vision-language model (agents/images.py)
        self.episodes: dict[str, EpisodeRecord] = {}
        self.stats = EndpointStats()
        self.port: int | None = None
        self.run_key = key or run_key()  # the root URL's key: it stays in the run's processes
        self._ids = itertools.count()
        self.id_prefix = id_prefix  # before each episode id: unique across the run's gateways and their replacements
        self._listener = Listener()

    # ---- episodes ---------------------------------------------------------------------------------------------

    def open_episode(self, example, trained: bool) -> EpisodeRecord:
        episode_id = f"{self.id_prefix}{'t' if trained else 'e'}{next(self._ids)}"
        record = EpisodeRecord(
            episode_id, example, trained, self.settings.non_prefix, self.chat, episode_key(episode_id)
        )
        self.episodes[episode_id] = record
        return record

    def close_episode(self, record: EpisodeRecord) -> None:
        record.closed = True
        self.episodes.pop(record.id, None)
        if (forget := getattr(self.generator, "forget_session", None)) is not None:
            record.replicas = forget(record.id) or set()  # its replica is free for others

    async def open(self, example, trained: bool) -> EpisodeRecord:
        """`open_episode`, as a gateway process's endpoint is called (forge_rl/agents/gateway_client.py)."""
        return self.open_episode(example, trained)

    async def close(self, record: EpisodeRecord) -> EpisodeRecord:
        """`close_episode`; the episode's record."""
        self.close_episode(record)
        return record

    async def call_counts(self) -> tuple[EndpointStats, int]:
        """What the endpoint counted, and the calls its open episodes made so far."""
        return self.stats, sum(r.calls for r in self.episodes.values())

    def base_url(self, record: EpisodeRecord | None = None) -> str:
        root = f"http://{url_host(self.settings.host)}:{self.port}"
        return f"{root}/v1" if record is None else f"{root}/episodes/{record.id}/v1"

    def admit(self, headers, url_episode: str | None, model_episode: str | None = None) -> EpisodeRecord | None:
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
        """Serve on settings.host:settings.port (0: a free port) from this event loop."""
        self.port = await self._listener.start(app(self), self.settings.host, self.settings.port)

    async def stop(self) -> None:
        """Stop serving (calls in flight get a moment to finish) and release the port (idempotent)."""
        await self._listener.stop()
        for record in list(self.episodes.values()):
            self.close_episode(record)

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
            session = None if record is None else record.id  # an episode's calls: one replica, its prefix cache
            completions = await self.generator.generate.route(
                prompt_ids, n=n, max_tokens=budget, session=session, **options
            )
        except (Exception, SupervisionError) as e:
            failure = getattr(e, "exception", e)
            if isinstance(failure, PromptTooLong):
                self._checked(record, lambda: _raise(Refused("prompt_too_long", str(failure))))
            message = f"generation failed: {type(failure).__name__}: {failure}".splitlines()[0][:300]
            if record is not None:
                record.fail("generation_error", message)
            raise GenerationFailed(message) from None
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


def _raise(error: Exception):
    raise error
