"""Many agent episodes at once against one run's endpoint: `--episodes` episodes open together on the gateway
process (agent.gateway.process: true, a run's default), each making two chat calls with tiny replies, all in
flight at the same time. Checks every episode's record against what its agent was answered, and reports the
gateway's and the controller's memory, round after round, to show it does not grow with the episodes served.

    .venv/bin/python -m benchmarks.agent_episodes [--episodes 1000] [--rounds 3] [--max-tokens 2] [--gateways 1]

Each episode is an agent of its own over plain HTTP (one shared connection pool, a key per episode): the question,
then the same conversation with its reply and "Wrong. Try again." So each second call continues the first's
recorded tokens. An episode's record is exact when it holds one trajectory whose context is the question as the chat
template renders it, and whose sampled tokens, call by call, decode to the texts the agent got, with one finite
logprob and one policy version per sampled token. A reply holding a special token its text leaves out starts a new
trajectory (about one in 300 at temperature 1 on tiny-warm): counted apart, not an error.
"""

import argparse
import asyncio
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from forge_rl.actors.generator import Generator
from forge_rl.actors.generator_engine import CPU_ENGINE_DEFAULTS
from forge_rl.agents.gateway_client import GatewayClient
from forge_rl.agents.gateways import Gateways
from forge_rl.agents.server import EndpointSettings
from forge_rl.models import load_tokenizer, model_path
from forge_rl.runtime import provisioned
from forge_rl.weights import WeightStoreConfig

QUESTION = [{"role": "user", "content": "12+34="}]
FEEDBACK = {"role": "user", "content": "Wrong. Try again."}
console = Console(width=140)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


async def agent(http: httpx.AsyncClient, url: str, key: str, max_tokens: int) -> tuple[list[str], list[float]]:
    """One agent's two calls to its episode's URL: (the two reply texts, seconds per call)."""
    texts, seconds, messages = [], [], list(QUESTION)
    for _ in range(2):
        start = time.perf_counter()
        body = dict(model="tiny-warm", messages=messages, max_tokens=max_tokens)
        reply = await http.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
        seconds.append(time.perf_counter() - start)
        reply.raise_for_status()
        texts.append(reply.json()["choices"][0]["message"]["content"] or "")
        messages = [*QUESTION, {"role": "assistant", "content": texts[0]}, FEEDBACK]
    return texts, seconds


def play(episodes: list[tuple[str, str]], max_tokens: int) -> tuple[list, float]:
    """Every episode's agent at once, in the agents' process: (each one's texts and seconds or its error, this
    process's resident MB). Agents run outside the controller, as a run's agent workers do."""

    async def all_at_once():
        limits = httpx.Limits(max_connections=len(episodes), max_keepalive_connections=len(episodes))
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as http:
            return await asyncio.gather(
                *(agent(http, url, key, max_tokens) for url, key in episodes), return_exceptions=True
            )

    results = asyncio.run(all_at_once())
    return [r if not isinstance(r, BaseException) else repr(r) for r in results], rss_mb(os.getpid())


def check(record, texts: list[str], tokenizer, question_ids: list[int]) -> str:
    """ "exact", "split" (a new trajectory, see the module doc) or what is wrong with the record."""
    if record.splits or len(record.trajectories) != 1:
        return "split"
    trajectory = record.trajectories[0]
    if trajectory.prompt_ids != question_ids:
        return "its context is not the question's rendering"
    if not len(trajectory.ids) == len(trajectory.logprobs) == len(trajectory.versions) == len(trajectory.env):
        return "its tokens, logprobs, versions and mask differ in length"
    runs, current = [], []  # the sampled ids of each call, split where the template's tokens are
    for token, env, logprob in zip(trajectory.ids, trajectory.env, trajectory.logprobs):
        if env and current:
            runs.append(current)
            current = []
        if not env:
            if not (math.isfinite(logprob) and logprob <= 0):
                return f"a sampled token's logprob is {logprob}"
            current.append(token)
    runs += [current] if current else []
    decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in runs]
    if decoded != texts:
        return f"its sampled tokens read {decoded}, the agent got {texts}"
    return "exact"


async def one_round(gateway, agents: ProcessPoolExecutor, episodes: int, max_tokens: int, tokenizer, question_ids):
    """Open `episodes` episodes, play them all at once in the agents' process, close them and check each record."""
    start = time.perf_counter()
    opened = await asyncio.gather(*(gateway.open(None, trained=True) for _ in range(episodes)))
    urls_keys = [(gateway.base_url(e), e.key) for e in opened]
    played, agents_mb = await asyncio.get_running_loop().run_in_executor(agents, play, urls_keys, max_tokens)
    records = await asyncio.gather(*(gateway.close(e) for e in opened))
    wall = time.perf_counter() - start
    verdicts, seconds, errors = {}, [], []
    for record, result in zip(records, played):
        if isinstance(result, str):
            errors.append(result)
            continue
        texts, taken = result
        verdict = check(record, texts, tokenizer, question_ids)
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
        seconds += taken
    return dict(wall=wall, verdicts=verdicts, seconds=sorted(seconds), errors=errors, agents_mb=agents_mb)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000, help="episodes open and calling at once")
    parser.add_argument("--rounds", type=int, default=3, help="times the episodes are served, memory read after each")
    parser.add_argument("--max-tokens", type=int, default=2, help="each reply's tokens at most")
    parser.add_argument("--gateways", type=int, default=1, help="gateway processes (agent.gateway.replicas)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(model_path("tiny-warm"))
    question = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    question_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    settings = EndpointSettings("tiny-warm", dict(temperature=1.0, max_tokens=args.max_tokens), max_model_len=128)
    rows = []
    # spawned, not forked: the agents' process holds none of the controller's Monarch or engine state
    agents = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    async with provisioned():
        generator = await Generator.options(replicas=1).as_service(
            model_path("tiny-warm"),
            engine_args={**CPU_ENGINE_DEFAULTS, "max_model_len": 128},
            sampling=dict(temperature=1.0, max_tokens=args.max_tokens),
            weight_store=WeightStoreConfig(host_id="bench-agent-episodes"),
        )
        if args.gateways > 1:
            gateway = Gateways(model_path("tiny-warm"), settings, generator, tokenizer, replicas=args.gateways)
        else:
            gateway = GatewayClient(model_path("tiny-warm"), settings, generator, tokenizer)
        await gateway.start()
        pids = gateway.pids if args.gateways > 1 else [gateway.pid]
        try:
            warm = await one_round(gateway, agents, 16, args.max_tokens, tokenizer, question_ids)
            rows.append(
                ("after a warm-up of 16", None, sum(rss_mb(p) for p in pids), rss_mb(os.getpid()), warm["agents_mb"])
            )
            for n in range(args.rounds):
                result = await one_round(gateway, agents, args.episodes, args.max_tokens, tokenizer, question_ids)
                rows.append(
                    (f"round {n + 1}", result, sum(rss_mb(p) for p in pids), rss_mb(os.getpid()), result["agents_mb"])
                )
                console.print(f"round {n + 1} of {args.rounds}: {args.episodes} episodes in {result['wall']:.1f} s")
            stats, open_calls = await gateway.call_counts()
        finally:
            agents.shutdown()
            await gateway.stop()
            await generator.shutdown()
    report(rows, args, stats, open_calls)


def report(rows: list, args, stats, open_calls: int) -> None:
    table = Table(title=f"{args.episodes} agent episodes at once, 2 calls each, replies of <= {args.max_tokens} tokens")
    columns = (
        "",
        "open to close s",
        "calls/s",
        "p50 ms",
        "p99 ms",
        "records",
        "errors",
        "gateways MB",
        "controller MB",
    )
    for col in (*columns, "agents MB"):
        table.add_column(col, justify="right")
    for name, result, *memory in rows:
        megabytes = [f"{mb:.0f}" for mb in memory]
        if result is None:
            table.add_row(name, "", "", "", "", "", "", *megabytes)
            continue
        seconds = result["seconds"]
        table.add_row(
            name,
            f"{result['wall']:.1f}",
            f"{len(seconds) / result['wall']:.1f}",
            f"{_p(seconds, 50):.0f}",
            f"{_p(seconds, 99):.0f}",
            ", ".join(f"{n} {verdict}" for verdict, n in sorted(result["verdicts"].items())),
            str(len(result["errors"])),
            *megabytes,
        )
    console.print(table)
    console.print(f"the gateway counted {stats.calls} calls; calls of episodes still open: {open_calls}")
    for name, result, *_ in rows:
        for error in (result or {}).get("errors", [])[:3]:
            console.print(f"{name}: {error}")


def _p(seconds: list[float], q: int) -> float:
    return seconds[min(len(seconds) - 1, round(q / 100 * (len(seconds) - 1)))] * 1e3 if seconds else math.nan


if __name__ == "__main__":
    asyncio.run(main())
