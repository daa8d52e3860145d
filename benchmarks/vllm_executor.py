"""vLLM's CPU engine with its model in the EngineCore process ("uni", forge_rl's default for one CPU rank)
against a Worker process of its own beside the EngineCore ("mp", vLLM's CPU default), and the EngineCore
spawned (vLLM's CPU default) against forked from the caller (forge_rl's default on CPU), side by side.

    python -m benchmarks.vllm_executor [--cores 0] [--rounds 2]

Each measurement is a fresh Python process pinned to `--cores` (as the provisioner pins a generator replica),
with the engine's OpenMP threads bound there too: it starts an AsyncLLM on the tiny model (the seconds until
the engine answers), then runs the demo's generation shape (16 concurrent workers, each one group of 8
completions of 8 tokens at a time, 640 groups after a warm-up) and reports groups/s. The modes alternate,
`rounds` times each; the table shows every run and the median ratios (uni / mp, both spawned as vLLM
does; fork / spawn, both uni).
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

PROMPT = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"


MODES = ("mp-spawn", "uni-spawn", "uni-fork")


async def measure(mode: str) -> dict:
    start = time.perf_counter()
    from transformers import AutoTokenizer
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from forge_rl.actors.generator_engine import CPU_ENGINE_DEFAULTS, ENGINE_DEFAULTS, cpu_engine_env, start_engine
    from forge_rl.models import TINY_MODEL_DIR

    model = str(TINY_MODEL_DIR)
    args = dict(model=model, seed=0, disable_log_stats=True, **ENGINE_DEFAULTS, **CPU_ENGINE_DEFAULTS)
    executor, process = mode.split("-")
    args = cpu_engine_env(args) if executor == "uni" else {**args, "distributed_executor_backend": "mp"}
    engine = start_engine(AsyncEngineArgs(**args), "fork" if process == "fork" else None)
    started = time.perf_counter() - start
    ids = AutoTokenizer.from_pretrained(model)(PROMPT, add_special_tokens=False)["input_ids"]
    params = SamplingParams(n=8, max_tokens=8, temperature=1.0, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
    count = 0

    async def worker(groups: int) -> None:
        nonlocal count
        for _ in range(groups):
            count += 1
            async for _ in engine.generate(TokensPrompt(prompt_token_ids=ids), params, f"g{count}"):
                pass

    await asyncio.gather(*(worker(5) for _ in range(16)))  # warm-up
    t = time.perf_counter()
    await asyncio.gather(*(worker(40) for _ in range(16)))
    groups_s = 16 * 40 / (time.perf_counter() - t)
    engine.shutdown()
    return dict(mode=mode, start_s=started, groups_s=groups_s)


def in_fresh_process(mode: str, cores: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(len(cores.split(","))), VLLM_CPU_OMP_THREADS_BIND=cores,
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    out = subprocess.run(["taskset", "-c", cores, sys.executable, "-m", "benchmarks.vllm_executor", "--one", mode],
                         env=env, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="0", help="CPU list the engine is pinned to (taskset syntax)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(measure(args.one))), flush=True)
        return
    console = Console()
    runs = []
    for r in range(args.rounds):
        for mode in MODES:
            with console.status(f"round {r + 1}/{args.rounds}: {mode}"):
                runs.append(in_fresh_process(mode, args.cores))
    table = Table(title=f"vLLM CPU executor, tiny model, pinned to cores {args.cores}")
    for col in ("mode", "engine start s", "groups/s (16 x G=8, 8 tokens)"):
        table.add_column(col)
    for run in runs:
        table.add_row(run["mode"], f"{run['start_s']:.1f}", f"{run['groups_s']:.1f}")
    med = {m: {k: statistics.median(x[k] for x in runs if x["mode"] == m) for k in ("start_s", "groups_s")}
           for m in MODES}
    ratios = (("uni / mp (median)", "uni-spawn", "mp-spawn"), ("fork / spawn (median)", "uni-fork", "uni-spawn"))
    for name, a, b in ratios:
        table.add_row(name, f"{med[a]['start_s'] / med[b]['start_s']:.2f}x",
                      f"{med[a]['groups_s'] / med[b]['groups_s']:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
