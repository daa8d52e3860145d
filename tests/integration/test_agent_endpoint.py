"""Agents through the run's OpenAI-compatible endpoint (forge_rl/agents), against the real openai client, vLLM and
TorchTitan: one synchronous fp32 GRPO run on tiny-warm whose agent (`two_turns` below) answers, hears "Wrong. Try
again." and answers again, driven step by step and shared by every test here. Its second call continues the
first call's sampled tokens exactly; the trainer's logprobs of its episodes' tokens match the engine's within the
bound the synchronous fp32 runs hold (tests/integration/test_mismatch.py); an edited history is split or refused;
tool calls come back as tool_calls; a different sampler is refused by name; a call without its episode's key is
refused; text sent back continues exactly; a program runs as an agent (agent.command); and every bad agent (a
function or a program) ends in one line."""

import asyncio
import json
import math
import socket
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import torch

from forge_rl.agents.command import LOG_NAME, CommandAgent
from forge_rl.agents.entry import AgentEntry
from forge_rl.config import load_config
from forge_rl.loop.rollout import DropLog, RolloutStats
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.rl_run import RLRun
from forge_rl.types import Completion
from tests.conftest import REPO
from tests.support.agent_runs import SMALL_SYNC_RUN

HERE = "tests.integration.test_agent_endpoint"
SEEN: list[dict] = []  # what two_turns' calls got back: prompt ids and sampled ids of each call


async def two_turns(example, client: openai.AsyncOpenAI) -> float:
    """The run's agent: a try, "Wrong. Try again.", a second try; reward 1 for a right answer on either."""
    messages = [dict(m) for m in example.messages]
    calls = []
    for _ in range(2):
        reply = await client.chat.completions.create(
            model="tiny-warm", messages=messages, logprobs=True, extra_body={"return_token_ids": True}
        )
        choice = reply.choices[0]
        calls.append({"prompt": reply.prompt_token_ids, "sampled": choice.token_ids})
        if (choice.message.content or "").strip() == example.answer:
            break
        messages += [
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": "Wrong. Try again."},
        ]
    SEEN.append({"calls": calls, "url": str(client.base_url)})
    return float(len(calls) == 1) + 0.5 * float((choice.message.content or "").strip() == example.answer)


async def raises(example, client):
    await client.chat.completions.create(model="m", messages=example.messages)
    raise ValueError("the agent's own bug")


async def hangs(example, client):
    await asyncio.sleep(3600)


async def returns_nan(example, client):
    await client.chat.completions.create(model="m", messages=example.messages)
    return math.nan


def returns_text(example, client: openai.OpenAI):  # a sync agent: it runs in a thread with a sync client
    client.chat.completions.create(model="m", messages=example.messages)
    return "1.0"


async def unknown_episode(example, client):
    wrong = openai.AsyncOpenAI(base_url=str(client.base_url).replace("/episodes/", "/episodes/x"), api_key="k")
    await wrong.chat.completions.create(model="m", messages=example.messages)


async def wrong_key(example, client):
    guessed = openai.AsyncOpenAI(base_url=client.base_url, api_key="forge-rl-episode-t0-guessed", max_retries=0)
    await guessed.chat.completions.create(model="m", messages=example.messages)


async def too_long(example, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1=" * 100}])


async def hotter(example, client):
    await client.chat.completions.create(model="m", messages=example.messages, temperature=0.5)
    return 1.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The shared run: started, two synchronous steps taken. Yields (event loop, run, the steps' lines)."""
    out = tmp_path_factory.mktemp("agent")
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        [
            f"output_dir={out}",
            f"agent.entry={HERE}:two_turns",
            "agent.workers=0",  # two_turns in this process, which reads what it saw (agent workers: test_agent_workers)
            # the endpoint in this process too: the tests read each episode's record as its calls come (the gateway
            # process that serves it by default hands a record over when the episode ends: test_agent_workers)
            "agent.gateway.process=false",
            "steps=2",
            *SMALL_SYNC_RUN,
        ],
    )
    loop = asyncio.new_event_loop()
    grpo = RLRun(cfg)
    loop.run_until_complete(grpo.start())
    try:
        lines = [loop.run_until_complete(grpo.rl_step()) for _ in range(2)]
        yield loop, grpo, lines
    finally:
        port = grpo.agents.server.port if grpo.agents else None
        loop.run_until_complete(grpo.stop())
        loop.close()
        if port is not None:  # nothing left listening
            with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                pass


def test_a_second_call_continues_the_first_calls_sampled_tokens(run):
    _, _, lines = run
    two = [s["calls"] for s in SEEN if len(s["calls"]) == 2]
    assert two, "no episode took a second try"
    for first, second in two:
        head = first["prompt"] + first["sampled"]
        assert second["prompt"][: len(head)] == head  # the engine's own tokens, not re-tokenised text
    assert len({s["url"] for s in SEEN}) == len(SEEN)  # each episode its own base URL
    assert all("/episodes/" in s["url"] for s in SEEN)
    assert all(line["reward/agent_calls"] >= 1 for line in lines if "reward/agent_calls" in line)


def test_the_trainers_logprobs_match_the_engines_on_agent_episodes(run):
    """Synchronous fp32 on both sides: only kernel-order rounding remains (the bound test_mismatch.py holds)."""
    _, _, lines = run
    for line in lines:
        assert line["trainer/mismatch_abs_mean"] < 1e-4 and line["trainer/mismatch_abs_max"] < 1e-3


def _episode_calls(run, trained: bool, *conversations, non_prefix: str = "split", **sent):
    """Calls of one episode through the real openai client, each with the messages `conversation(replies)` makes
    of the replies so far and the options `sent`. Returns (its record, the replies, or the error that ended them)."""
    loop, grpo, _ = run
    server = grpo.agents.server
    server.settings.non_prefix = non_prefix
    record = server.open_episode(None, trained)
    client = openai.AsyncOpenAI(base_url=server.base_url(record), api_key=record.key, max_retries=0)

    async def calls():
        got = []
        for conversation in conversations:
            try:
                got.append(await client.chat.completions.create(model="m", messages=conversation(got), **sent))
            except openai.APIStatusError as e:
                return got + [e]
        return got

    try:
        return record, loop.run_until_complete(calls())
    finally:
        server.settings.non_prefix = "split"
        server.close_episode(record)
        loop.run_until_complete(client.close())


QUESTION = [{"role": "user", "content": "12+34="}]


def _asked(got):
    return QUESTION


def _edited(got):
    return [*QUESTION, {"role": "assistant", "content": "x" + (got[0].choices[0].message.content or "")}, *QUESTION]


def test_an_edited_history_splits_the_episode_or_is_refused(run):
    record, got = _episode_calls(run, True, _asked, _edited)
    assert all(isinstance(g, openai.types.chat.ChatCompletion) for g in got)
    assert record.splits == 1 and len(record.trajectories) == 2
    record, got = _episode_calls(run, True, _asked, _edited, non_prefix="refuse")
    assert isinstance(got[-1], openai.BadRequestError) and "non_prefix: refuse" in str(got[-1])
    assert record.failure[0] == "agent_non_prefix" and len(record.trajectories) == 1


def test_a_different_sampler_is_refused_by_name_in_training_and_allowed_in_evaluation(run):
    for field, value, sent in (
        ("temperature", 0.5, {"temperature": 0.5}),
        ("top_p", 0.9, {"top_p": 0.9}),
        ("top_k", 5, {"extra_body": {"top_k": 5}}),
    ):
        record, got = _episode_calls(run, True, _asked, **sent)
        assert isinstance(got[0], openai.BadRequestError), field
        assert f"{field}={value} differs from the run's generator.sampling.{field}" in str(got[0])
        assert record.failure[0] == "agent_request"  # the episode's group would be dropped, counted
    record, got = _episode_calls(run, True, _asked, temperature=1.0)  # the run's own value is fine
    assert isinstance(got[0], openai.types.chat.ChatCompletion) and record.failure is None
    record, got = _episode_calls(run, False, _asked, _asked, temperature=0.0)
    assert got[0].choices[0].message.content == got[1].choices[0].message.content  # evaluation: greedy allowed


def test_tool_calls_come_back_as_openai_tool_calls(run):
    """The tiny model writes no tool call itself, so a reply holding one (Qwen3's Hermes format) is given as the
    engine's tokens: the endpoint's choice, parsed by vLLM's Hermes parser, validates as the openai client's type.
    A request with tools is served end to end."""
    loop, grpo, _ = run
    server = grpo.agents.server
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    request = server.protocol.ChatCompletionRequest.model_validate({"messages": QUESTION, "tools": tools})
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
    ids = server.tokenizer(text, add_special_tokens=False)["input_ids"] + [server.tokenizer.eos_token_id]
    sampled = Completion(
        torch.tensor([1]), torch.tensor(ids), torch.zeros(len(ids)), torch.zeros(len(ids), dtype=torch.long), "stop"
    )
    reply, choice = server.chat_choice(0, sampled, request, {})
    response = server.protocol.ChatCompletionResponse(
        model="m", choices=[choice], usage=server.protocol.UsageInfo()
    ).model_dump(exclude_none=True)
    parsed = openai.types.chat.ChatCompletion.model_validate(response).choices[0]
    assert parsed.finish_reason == "tool_calls" and parsed.message.tool_calls[0].function.name == "add"
    assert json.loads(parsed.message.tool_calls[0].function.arguments) == {"a": 12, "b": 34}
    assert reply.raw == text  # the episode keeps what the model wrote, for the next call's continuation
    _, got = _episode_calls(run, True, _asked, tools=tools)
    assert isinstance(got[0], openai.types.chat.ChatCompletion)


def test_models_completions_and_an_unknown_episode(run):
    loop, grpo, _ = run
    server = grpo.agents.server
    root = openai.AsyncOpenAI(base_url=server.base_url(), api_key=server.run_key, max_retries=0)
    record = server.open_episode(None, False)  # greedy: no rare token (a special one is not in the text returned)
    episode = openai.AsyncOpenAI(base_url=server.base_url(record), api_key=record.key, max_retries=0)

    async def calls():
        models = await root.models.list()
        first = await episode.completions.create(model="m", prompt="12+34=", max_tokens=4)
        end = "<|im_end|>" if first.choices[0].finish_reason == "stop" else ""  # the text leaves it out
        second = await episode.completions.create(model="m", prompt="12+34=" + first.choices[0].text + end + " 1+1=")
        with pytest.raises(openai.NotFoundError, match="no open episode 'nope'"):
            await openai.AsyncOpenAI(
                base_url=server.base_url().replace("/v1", "/episodes/nope/v1"), api_key="k"
            ).models.list()
        return models, first, second

    models, first, second = loop.run_until_complete(calls())
    assert [m.id for m in models.data] == [grpo.cfg.model]
    assert record.calls == 2 and len(record.trajectories) == 1 and record.splits == 0  # the second continued
    server.close_episode(record)
    loop.run_until_complete(root.close())
    loop.run_until_complete(episode.close())


def test_a_call_without_its_episodes_key_is_refused_and_never_recorded(run):
    """Each episode's URL takes its own key only; the root URL the run's (or, for a call naming its episode in the
    model, that episode's). A refused call is a 401 (openai.AuthenticationError) and leaves the episode as it was."""
    loop, grpo, _ = run
    server = grpo.agents.server
    mine, other = server.open_episode(None, True), server.open_episode(None, True)
    url, named = server.base_url(mine), f"m@episode/{mine.id}"

    async def calls():
        for key in (other.key, server.run_key, "forge-rl", mine.key + "x"):
            async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
                with pytest.raises(openai.AuthenticationError, match=f"wrong API key for episode {mine.id}"):
                    await client.chat.completions.create(model="m", messages=QUESTION)
                with pytest.raises(openai.AuthenticationError):
                    await client.completions.create(model="m", prompt="12+34=")
                with pytest.raises(openai.AuthenticationError):
                    await client.models.list()
        async with httpx.AsyncClient() as http:  # no Authorization header at all
            refused = await http.post(f"{url}/chat/completions", json={"model": "m", "messages": QUESTION})
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        async with openai.AsyncOpenAI(base_url=server.base_url(), api_key=other.key, max_retries=0) as root:
            with pytest.raises(openai.AuthenticationError, match="the root URL takes the run's key"):
                await root.models.list()
            with pytest.raises(openai.AuthenticationError, match=f"wrong API key for episode {mine.id}"):
                await root.chat.completions.create(model=named, messages=QUESTION)
        assert mine.calls == 0 and not mine.trajectories and mine.failure is None  # nothing of them recorded
        async with openai.AsyncOpenAI(base_url=server.base_url(), api_key=mine.key, max_retries=0) as root:
            await root.chat.completions.create(model=named, messages=QUESTION)  # its own key names it
        async with openai.AsyncOpenAI(base_url=url, api_key=mine.key, max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=QUESTION)

    try:
        loop.run_until_complete(calls())
    finally:
        server.close_episode(mine)
        server.close_episode(other)
    assert mine.calls == 2 and other.calls == 0 and mine.failure is None


CHAT_PROMPT = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
NEXT_TURN = "<|im_end|>\n<|im_start|>user\nWrong. Try again.<|im_end|>\n<|im_start|>assistant\n"


def _text_episode(run, stop: list[str] | None):
    """A /v1/completions agent that renders its turns itself, as a real one does: a greedy answer (an evaluation
    episode: the same recording, a reply that is the same each time), then its prompt, the text it got, the stop
    string that ended it (the end-of-turn token is written by NEXT_TURN) and the next user turn. Returns (its
    record, the text it sent second, the two choices)."""
    loop, grpo, _ = run
    server = grpo.agents.server
    record = server.open_episode(None, trained=False)
    client = openai.AsyncOpenAI(base_url=server.base_url(record), api_key=record.key, max_retries=0)
    ids = {"return_token_ids": True}

    async def calls():
        first = (await client.completions.create(model="m", prompt=CHAT_PROMPT, stop=stop, extra_body=ids)).choices[0]
        sent = CHAT_PROMPT + first.text + (stop[0] if stop else "") + NEXT_TURN
        second = (await client.completions.create(model="m", prompt=sent, extra_body=ids)).choices[0]
        return sent, first, second

    try:
        return (record, *loop.run_until_complete(calls()))
    finally:
        server.close_episode(record)
        loop.run_until_complete(client.close())


def test_text_sent_back_continues_the_recorded_tokens_exactly(run):
    """The text returned leaves out the sampled end-of-turn token (or the stop string); the agent writes its own
    after it, and the engine sees each once: the prompt is token for token what the agent's text renders."""
    _, grpo, _ = run
    tokenizer = grpo.agents.server.tokenizer
    record, _, answer, _ = _text_episode(run, None)
    assert answer.finish_reason == "stop" and answer.token_ids[-1] == tokenizer.eos_token_id, answer
    assert len(answer.text) >= 2, answer  # a stop string inside the answer, for the second case
    for stop in (None, [answer.text[-1]]):
        record, sent, first, second = _text_episode(run, stop)
        assert first.text == (answer.text if stop is None else answer.text[: answer.text.index(stop[0])])
        rendered = tokenizer(sent, add_special_tokens=False)["input_ids"]
        assert second.prompt_token_ids == rendered, (stop, sent)
        assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.token_ids)] == (
            first.prompt_token_ids + first.token_ids
        )  # the engine's own tokens stand for the reply, the stop string's included
        assert record.calls == 2 and record.splits == 0 and len(record.trajectories) == 1


@pytest.mark.parametrize(
    "agent, reason, says",
    [
        ("raises", "agent_error", "raised ValueError: the agent's own bug"),
        ("hangs", "agent_timeout", "did not return within agent.episode_timeout_s=2"),
        ("returns_nan", "agent_reward", "returned nan; return a finite number or None"),
        ("returns_text", "agent_reward", "returned '1.0'; return a finite number or None"),
        ("unknown_episode", "agent_error", "no open episode"),
        ("wrong_key", "agent_error", "AuthenticationError: Error code: 401"),
        ("too_long", "prompt_too_long", "max_model_len"),
        ("hotter", "agent_request", "temperature=0.5 differs"),
    ],
)
def test_a_bad_agent_costs_its_group_in_one_line(run, agent, reason, says):
    group, stats, lines = _one_group(run, AgentEntry(f"{HERE}:{agent}", timeout_s=2, max_threads=4))
    runner = run[1].agents
    assert group is None and stats.drops[reason] == (1 if reason == "prompt_too_long" else 2)
    assert len(lines) == 1 and "\n" not in lines[0] and says in lines[0] and f"({reason})" in lines[0], lines
    assert not runner.server.episodes  # every episode of the group closed


def _one_group(run, entry: AgentEntry):
    """A group of the dataset's next example played by `entry` in place of the run's agent: (the Group or None,
    its RolloutStats, the drop lines it printed)."""
    loop, grpo, _ = run
    runner = grpo.agents
    lines: list[str] = []
    stats = RolloutStats(drop_log=DropLog(write=lines.append))
    kept, runner.entry = runner.entry, entry
    try:
        example = loop.run_until_complete(grpo.roles.dataset.next.call_one())
        return loop.run_until_complete(runner.group(example, 2, grpo.roles.reward, stats)), stats, lines
    finally:
        loop.run_until_complete(entry.close())
        runner.entry = kept


def _program(code: str, timeout_s: float = 30, max_output_bytes: int = 10_000) -> AgentEntry:
    command = [sys.executable, "-c", code]
    return AgentEntry("command", timeout_s, 4, fn=CommandAgent(command, max_output_bytes))


MARK = f"forge-rl-test-{uuid.uuid4().hex}"  # in every test program's command line: none may outlive its episode
CALL = (  # one chat call of its episode, with the standard library only
    f"# {MARK}\nimport json, os, subprocess, sys, time, urllib.request\nrow = json.load(sys.stdin)\n"
    "request = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', "
    "data=json.dumps({'model': 'm', 'messages': row['messages']}).encode(), headers={'Content-Type': "
    "'application/json', 'Authorization': 'Bearer ' + os.environ.get('OPENAI_API_KEY', '')})\n"
    "reply = json.load(urllib.request.urlopen(request))['choices'][0]['message']['content']\n"
)


def _left_running() -> list[str]:
    """The test programs still running, once a SIGKILL sent to them has had a moment to land."""
    for _ in range(20):
        left = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _has_mark(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def _has_mark(proc: Path) -> bool:
    try:
        return MARK.encode() in (proc / "cmdline").read_bytes()
    except OSError:  # it ended meanwhile
        return False


def test_a_program_is_an_agent(run):
    """examples/agents/http_agent.py, plain HTTP: its episodes' calls, its reward from stdout, its stderr in the
    run's log. A program that prints nothing on stdout is scored by the run's rewards."""
    _, grpo, _ = run
    entry = AgentEntry("command", 60, 4, fn=CommandAgent([sys.executable, "examples/agents/http_agent.py"], 10_000))
    group, stats, lines = _one_group(run, entry)
    assert group is not None and not lines and not any(stats.drops.values())
    assert {e.reward for e in group.episodes} <= {0.0, 0.5, 1.0} and all(
        e.metadata["calls"] >= 1 for e in group.episodes
    )
    assert "answered" in (Path(grpo.log_dir) / LOG_NAME).read_text()
    group, stats, lines = _one_group(run, _program(CALL))  # no reward printed: exact_match scores its reply
    assert group is not None and not lines and all(e.rewards == {"agent": e.reward} for e in group.episodes)


@pytest.mark.parametrize(
    "code, reason, says, limits",
    [
        (
            "print('no sandbox here', file=sys.stderr)\nsys.exit(3)",
            "agent_error",
            "status 3; its last stderr line: no sandbox here",
            {},
        ),
        ("print('the answer is', reply)", "agent_reward", "last on stdout, not JSON", {}),
        ("print(json.dumps({'reward': 'high'}))", "agent_reward", '{"reward": "high"}', {}),
        (
            "sys.stdout.write('x' * 100000)",
            "agent_output",
            "more than agent.max_output_bytes=1000 bytes",
            {"max_output_bytes": 1000},
        ),
        (
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600) # {MARK}'])\ntime.sleep(600)",
            "agent_timeout",
            "did not return within agent.episode_timeout_s=3",
            {"timeout_s": 3},
        ),
    ],
    ids=["exits-3", "no-json", "not-a-number", "floods-stdout", "hangs-with-a-child"],
)
def test_a_bad_program_costs_its_group_in_one_line(run, code, reason, says, limits):
    group, stats, lines = _one_group(run, _program(CALL + code, **limits))
    assert group is None and stats.drops[reason] == 2
    assert len(lines) == 1 and "\n" not in lines[0] and says in lines[0] and f"({reason})" in lines[0], lines
    assert not run[1].agents.server.episodes and not _left_running()  # nothing it started outlives it


def test_a_program_with_another_key_is_refused(run):
    """OPENAI_API_KEY is its episode's; a program that calls with another key gets a 401 and its group is dropped."""
    code = CALL.replace("os.environ.get('OPENAI_API_KEY', '')", "'forge-rl-episode-t0-guessed'")
    group, stats, lines = _one_group(run, _program(code))
    assert group is None and stats.drops["agent_error"] == 2 and "HTTP Error 401" in lines[0], lines
