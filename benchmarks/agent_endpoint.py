"""The agent endpoint's cost per call: the same requests through the run's OpenAI-compatible endpoint (the real
openai client, HTTP on loopback, vLLM's protocol models, the chat template, the episode's recording) and straight
to the generator service (`generator.generate.route`, as the built-in rollouts call it), one after the other on
one tiny-warm Generator.

    .venv/bin/python -m benchmarks.agent_endpoint [--calls 200] [--concurrency 16]

1. Latency: `calls` requests one at a time: a question, then (the agent's second turn) the same conversation with
   "Wrong. Try again." after the reply, so half the calls continue an episode's recorded tokens. Reports the mean
   and median per call of each path and their difference (the endpoint's cost per call), and the part of it spent
   in the endpoint's own code (AgentServer's counters: parsing, rendering, recording, answering).
2. Throughput: the same pairs of calls, `concurrency` episodes at once; calls/s of each path.
Every reply is at most 8 tokens (the tiny demos' max_tokens) at temperature 1.0, so generation is short and the
endpoint's cost is as large a share of a call as it will be.
"""

import argparse
import asyncio
import statistics
import time

import openai
from rich.console import Console
from rich.table import Table

from forge_rl.actors.generator import Generator
from forge_rl.actors.generator_engine import CPU_ENGINE_DEFAULTS
from forge_rl.agents.server import AgentServer, EndpointSettings
from forge_rl.models import load_tokenizer, model_path
from forge_rl.runtime import provisioned
from forge_rl.weights import WeightStoreConfig

SAMPLING = dict(temperature=1.0, max_tokens=8)
QUESTION = [{"role": "user", "content": "12+34="}]
FEEDBACK = {"role": "user", "content": "Wrong. Try again."}
console = Console()


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


async def endpoint_pair(server: AgentServer, http) -> list[float]:
    """The same two calls through the endpoint, as an agent makes them, in an episode of their own (its client on
    the connection pool every episode shares, as a run's agents have: forge_rl/agents/entry.py)."""
    record = server.open_episode(None, trained=True)
    client = openai.AsyncOpenAI(base_url=server.base_url(record), api_key=record.key, max_retries=0, http_client=http)
    try:
        t0 = time.perf_counter()
        reply = await client.chat.completions.create(model="tiny-warm", messages=QUESTION)
        t1 = time.perf_counter()
        answer = {"role": "assistant", "content": reply.choices[0].message.content}
        await client.chat.completions.create(model="tiny-warm", messages=[*QUESTION, answer, FEEDBACK])
        assert record.splits == 0 and len(record.trajectories) == 1  # the second call continued the first's tokens
        return [t1 - t0, time.perf_counter() - t1]
    finally:
        server.close_episode(record)


async def timed(pair, calls: int, concurrency: int) -> tuple[list[float], float]:
    """Per-call seconds of `calls` calls (pairs at `concurrency` at once), and calls/s over the whole."""
    slots, latencies = asyncio.Semaphore(concurrency), []

    async def one():
        async with slots:
            latencies.extend(await pair())

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls // 2)))
    return latencies, len(latencies) / (time.perf_counter() - start)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    tokenizer = load_tokenizer(model_path("tiny-warm"))
    async with provisioned():
        generator = await Generator.options(replicas=1).as_service(
            model_path("tiny-warm"),
            engine_args={**CPU_ENGINE_DEFAULTS, "max_model_len": 128},
            sampling=SAMPLING,
            weight_store=WeightStoreConfig(host_id="bench-agent-endpoint"),
        )
        settings = EndpointSettings("tiny-warm", dict(SAMPLING), max_model_len=128)
        server = AgentServer(tokenizer, generator, settings)
        await server.start()
        http = openai.DefaultAsyncHttpxClient()
        try:
            await timed(lambda: direct_pair(generator, tokenizer), 20, 4)  # warm-up of both paths
            await timed(lambda: endpoint_pair(server, http), 20, 4)
            rows = []
            for concurrency in (1, args.concurrency):
                direct, direct_rate = await timed(lambda: direct_pair(generator, tokenizer), args.calls, concurrency)
                before = (server.stats.calls, server.stats.overhead_s)
                through, through_rate = await timed(lambda: endpoint_pair(server, http), args.calls, concurrency)
                inside = (server.stats.overhead_s - before[1]) / (server.stats.calls - before[0])
                rows.append((concurrency, direct, direct_rate, through, through_rate, inside))
        finally:
            await http.aclose()
            await server.stop()
            await generator.shutdown()
    table = Table(title=f"agent endpoint vs the generator, {args.calls} calls per row (tiny-warm, CPU)")
    for col in ("episodes at once", "path", "mean ms/call", "median ms/call", "calls/s", "endpoint code ms/call"):
        table.add_column(col, justify="right")
    for concurrency, direct, direct_rate, through, through_rate, inside in rows:
        table.add_row(str(concurrency), "generator", *_row(direct, direct_rate), "")
        table.add_row(str(concurrency), "endpoint", *_row(through, through_rate), f"{inside * 1e3:.1f}")
        cost = statistics.mean(through) - statistics.mean(direct)
        table.add_row(
            str(concurrency), "difference", f"{cost * 1e3:+.1f}", "", f"{through_rate / direct_rate:.2f}x", ""
        )
    console.print(table)


def _row(latencies: list[float], rate: float) -> tuple[str, str, str]:
    mean, median = statistics.mean(latencies), statistics.median(latencies)
    return f"{mean * 1e3:.1f}", f"{median * 1e3:.1f}", f"{rate:.1f}"


if __name__ == "__main__":
    asyncio.run(main())
