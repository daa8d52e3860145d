"""The agent endpoint's cost per call: the same requests through the run's OpenAI-compatible endpoint (the real
openai client, HTTP on loopback, vLLM's protocol models, the chat template, the episode's recording) and straight
to the generator service (`generator.generate.route`, as the built-in rollouts call it), one after the other on
one tiny-warm Generator. The endpoint is measured where a run serves it: in a gateway process of its own
(agent.gateway.process: true, the default), and in the calling process (false).

    .venv/bin/python -m benchmarks.agent_endpoint [--calls 200] [--concurrency 16] [--paths gateway,in-process]

1. Latency: `calls` requests one at a time: a question, then (the agent's second turn) the same conversation with
   "Wrong. Try again." after the reply, so half the calls continue an episode's recorded tokens. Reports the mean,
   median (p50) and p99 per call of each path and the p50/p99 each endpoint adds to the generator's, and the part
   of a call spent in the endpoint's own code (AgentServer's counters: parsing, rendering, recording, answering).
2. Throughput: the same pairs of calls, `concurrency` episodes at once; calls/s of each path.
Every reply is at most 8 tokens (the tiny demos' max_tokens) at temperature 1.0, so generation is short and the
endpoint's cost is as large a share of a call as it will be.
"""

import argparse
import asyncio
import collections
import statistics
import time

import openai
from rich.console import Console
from rich.table import Table

from forge_rl.actors.generator import Generator
from forge_rl.actors.generator_engine import CPU_ENGINE_DEFAULTS
from forge_rl.agents.gateway_client import GatewayClient
from forge_rl.agents.server import AgentServer, EndpointSettings
from forge_rl.models import load_tokenizer, model_path
from forge_rl.runtime import provisioned
from forge_rl.weights import WeightStoreConfig

SAMPLING = dict(temperature=1.0, max_tokens=8)
QUESTION = [{"role": "user", "content": "12+34="}]
FEEDBACK = {"role": "user", "content": "Wrong. Try again."}
console = Console(width=140)
SPLIT = collections.Counter()  # endpoint episodes: True, split; False, continued


async def direct_pair(generator, tokenizer) -> list[float]:
    """An agent's two calls straight to the generator: the question, then the conversation continued on the
    reply's tokens (as forge_rl/loop/multiturn.py does), each timed."""
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    first = (await generator.generate.route(ids, n=1, **SAMPLING))[0]
    t1 = time.perf_counter()
    feedback = "<|im_end|>\n<|im_start|>user\nWrong. Try again.<|im_end|>\n<|im_start|>assistant\n"
    more = tokenizer(feedback, add_special_tokens=False)["input_ids"]
    await generator.generate.route(ids + first.response_ids.tolist() + more, n=1, **SAMPLING)
    return [t1 - t0, time.perf_counter() - t1]


async def endpoint_pair(server: AgentServer | GatewayClient, http) -> list[float]:
    """The same two calls through the endpoint, as an agent makes them, in an episode of their own (its client on
    the connection pool every episode shares, as a run's agents have: forge_rl/agents/entry.py)."""
    episode = await server.open(None, trained=True)
    client = openai.AsyncOpenAI(base_url=server.base_url(episode), api_key=episode.key, max_retries=0, http_client=http)
    t0 = time.perf_counter()
    reply = await client.chat.completions.create(model="tiny-warm", messages=QUESTION)
    t1 = time.perf_counter()
    answer = {"role": "assistant", "content": reply.choices[0].message.content}
    await client.chat.completions.create(model="tiny-warm", messages=[*QUESTION, answer, FEEDBACK])
    t2 = time.perf_counter()
    record = await server.close(episode)
    # the second call continues the first's tokens, unless the reply holds a token its text leaves out (a special
    # token sampled at temperature 1): then the episode splits, about one in 300 on tiny-warm, whichever path
    SPLIT[record.splits > 0 or len(record.trajectories) != 1] += 1
    return [t1 - t0, t2 - t1]


async def timed(pair, calls: int, concurrency: int) -> tuple[list[float], float]:
    """Per-call seconds of `calls` calls (pairs at `concurrency` at once), and calls/s over the whole."""
    slots, latencies = asyncio.Semaphore(concurrency), []

    async def one():
        async with slots:
            latencies.extend(await pair())

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls // 2)))
    return latencies, len(latencies) / (time.perf_counter() - start)


async def endpoints(generator, tokenizer, paths: list[str]) -> dict:
    """The endpoints measured, by path name, started on `generator`."""
    settings = EndpointSettings("tiny-warm", dict(SAMPLING), max_model_len=128)
    started = {}
    for path in paths:
        if path == "gateway":
            started[path] = await GatewayClient(model_path("tiny-warm"), settings, generator, tokenizer).start()
        else:
            started[path] = AgentServer(tokenizer, generator, settings)
            await started[path].start()
    return started


async def measure(generator, tokenizer, servers: dict, http, calls: int, concurrency: int) -> list[tuple]:
    """(path, per-call seconds, calls/s, the endpoint's own ms per call) of each path at `concurrency`."""
    direct, rate = await timed(lambda: direct_pair(generator, tokenizer), calls, concurrency)
    rows = [("generator", direct, rate, None)]
    for path, server in servers.items():
        before, _ = await server.call_counts()
        before = (before.calls, before.overhead_s)
        through, rate = await timed(lambda server=server: endpoint_pair(server, http), calls, concurrency)
        after, _ = await server.call_counts()
        rows.append((path, through, rate, (after.overhead_s - before[1]) / (after.calls - before[0])))
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--paths", default="gateway,in-process", help="endpoints measured: gateway, in-process")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    if not set(paths) <= {"gateway", "in-process"}:
        parser.error(f"--paths={args.paths}: give gateway, in-process or both")
    tokenizer = load_tokenizer(model_path("tiny-warm"))
    async with provisioned():
        generator = await Generator.options(replicas=1).as_service(
            model_path("tiny-warm"),
            engine_args={**CPU_ENGINE_DEFAULTS, "max_model_len": 128},
            sampling=SAMPLING,
            weight_store=WeightStoreConfig(host_id="bench-agent-endpoint"),
        )
        servers = await endpoints(generator, tokenizer, paths)
        http = openai.DefaultAsyncHttpxClient()
        try:
            await timed(lambda: direct_pair(generator, tokenizer), 20, 4)  # warm-up of every path
            for server in servers.values():
                await timed(lambda server=server: endpoint_pair(server, http), 20, 4)
            rows = {c: await measure(generator, tokenizer, servers, http, args.calls, c) for c in (1, args.concurrency)}
        finally:
            await http.aclose()
            for server in servers.values():
                await server.stop()
            await generator.shutdown()
    report(rows, args.calls)


def report(rows: dict, calls: int) -> None:
    table = Table(title=f"agent endpoint vs the generator, {calls} calls per row (tiny-warm, CPU)")
    for col in ("episodes at once", "path", "mean ms", "p50 ms", "p99 ms", "calls/s", "x direct", "own code ms"):
        table.add_column(col, justify="right")
    for concurrency, measured in rows.items():
        _, direct, direct_rate, _ = measured[0]
        for path, latencies, rate, inside in measured:
            added = "" if inside is None else f" ({_p(latencies, 50) - _p(direct, 50):+.1f})"
            added99 = "" if inside is None else f" ({_p(latencies, 99) - _p(direct, 99):+.1f})"
            table.add_row(
                str(concurrency),
                path,
                f"{statistics.mean(latencies) * 1e3:.1f}",
                f"{_p(latencies, 50):.1f}{added}",
                f"{_p(latencies, 99):.1f}{added99}",
                f"{rate:.1f}",
                f"{rate / direct_rate:.2f}x",
                "" if inside is None else f"{inside * 1e3:.1f}",
            )
    console.print(table)
    console.print("p50/p99 in brackets: what the endpoint adds per call to the generator's own")
    console.print(f"episodes whose second call did not continue the first's tokens: {SPLIT[True]} of {SPLIT.total()}")


def _p(latencies: list[float], q: int) -> float:
    """The q-th percentile of `latencies`, in ms."""
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] * 1e3


if __name__ == "__main__":
    asyncio.run(main())
