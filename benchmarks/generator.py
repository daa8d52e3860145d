"""Generator benchmark: actor overhead vs raw vLLM, and the cost of live weight updates per swap mode.

    .venv/bin/python -m benchmarks.generator [--sizes tiny,100M] [--rounds 6] [--every 2]

1. Throughput: the same workload (G prompts x n completions, fixed length) through a raw `AsyncLLM` in a
   Python process of its own (as the actor's engine has its proc; it shares nothing with this benchmark's
   event loop) and through the Generator actor (Monarch calls, per-token version tagging, streaming), same
   engine arguments, one after the other in the same run. Target: actor >= 0.95x raw.
2. Updates: for each model size and swap mode, `rounds` rounds of the workload run back to back while the
   weights are updated every `every` rounds (a trainer step every k generation rounds) from new versions in
   the weight store. Reports the pause per update (generation stopped), the drain wait (drain mode: the
   engine running below capacity while in-flight requests finish), tokens in flight at the swap, and the
   fraction of generation wall time lost to updates = (pauses + drain waits) / wall time.
3. The weight store on the path vLLM uses, per model size: publish (the trainer's write of every tensor
   into the version's shared-memory safetensors file: one copy) and the engine's reload (vLLM's
   `reload_weights` from that file inside the paused engine: one copy into the engine's parameters plus,
   on CPU, oneDNN's repacking of every linear layer), each as seconds and GB/s of model bytes.
"100M" is a random char-level Qwen3 (hidden 768, 14 layers) built into a temporary directory. Each size
has a weight store of its own (a generator loads the newest published version when it starts).
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from forge_rl.actors.generator import Generator
from forge_rl.actors.generator_modes import SWAP_MODES
from forge_rl.actors.generator_engine import CPU_ENGINE_DEFAULTS, ENGINE_DEFAULTS
from forge_rl.runtime import provisioned, stop_actor
from forge_rl.models import TINY_MODEL_DIR

SIZES = {
    "tiny": None,
    "100M": dict(
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=14,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
PROMPT = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
console = Console()


def engine_args() -> dict:
    args = dict(ENGINE_DEFAULTS, max_model_len=256)
    if not torch.cuda.is_available():
        args = {**CPU_ENGINE_DEFAULTS, **args}
    return args


async def raw_engine_tok_s(model: str, groups: int, n: int, tokens: int) -> float:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from transformers import AutoTokenizer

    from forge_rl.deps.vllm import async_llm

    engine = async_llm().from_engine_args(AsyncEngineArgs(model=model, seed=0, disable_log_stats=True, **engine_args()))
    ids = AutoTokenizer.from_pretrained(model)(PROMPT, add_special_tokens=False)["input_ids"]
    params = SamplingParams(n=n, max_tokens=tokens, ignore_eos=True, logprobs=0, output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> int:
        count = 0
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, f"raw-{i}"):
            count += sum(len(c.token_ids) for c in out.outputs)
        return count

    try:
        await asyncio.gather(*(one(-1 - i) for i in range(groups)))  # warm-up
        start = time.perf_counter()
        total = sum(await asyncio.gather(*(one(i) for i in range(groups))))
        return total / (time.perf_counter() - start)
    finally:
        engine.shutdown()


def raw_engine_in_own_process(model: str, groups: int, n: int, tokens: int) -> float:
    """`raw_engine_tok_s` in a fresh Python process (`--raw MODEL`), so that no event loop, Monarch
    runtime or actor of this process competes with the raw engine's."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.generator",
        "--raw",
        model,
        "--groups",
        str(groups),
        "--n",
        str(n),
        "--tokens",
        str(tokens),
    ]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tok_s"]


async def actor_round(gen, groups: int, n: int, tokens: int) -> int:
    results = await asyncio.gather(
        *(gen.generate.call_one(PROMPT, n=n, max_tokens=tokens, ignore_eos=True) for _ in range(groups))
    )
    return sum(len(c.response_ids) for group in results for c in group)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,100M")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--every", type=int, default=2, help="update the weights every k rounds")
    ap.add_argument("--raw", metavar="MODEL", help="only measure the raw engine on MODEL and print its tok/s as JSON")
    args = ap.parse_args()
    if args.raw:
        tok_s = await raw_engine_tok_s(args.raw, args.groups, args.n, args.tokens)
        print(json.dumps(dict(tok_s=tok_s)), flush=True)
        return
    from safetensors.torch import load_file

    from forge_rl.models.build_tiny import build
    from forge_rl.weights import ShmWeightStore, WeightStoreConfig

    throughput = Table(title=f"generation throughput, {args.groups} groups x n={args.n} x {args.tokens} tokens")
    for col in ("model", "raw AsyncLLM tok/s", "Generator actor tok/s", "actor / raw"):
        throughput.add_column(col, justify="right")
    updates = Table(title=f"live weight updates: {args.rounds} rounds, one update every {args.every} rounds")
    for col in (
        "model",
        "mode",
        "updates",
        "reload+pause s (median)",
        "drain wait s (median)",
        "tokens in flight",
        "tok/s",
        "time lost to updates",
    ):
        updates.add_column(col, justify="right")
    store_table = Table(title="weight store on vLLM's reload path (medians over every update)")
    for col in ("model", "MB", "publish s", "publish GB/s", "engine reload + pause s", "reload GB/s"):
        store_table.add_column(col, justify="right")

    async with provisioned():
        version = 0
        for size in args.sizes.split(","):
            store_cfg = WeightStoreConfig(host_id=f"bench-{size}")  # versions of this size only
            store = ShmWeightStore(cfg=store_cfg)
            publish_s: list[float] = []
            reloads: list[float] = []
            with tempfile.TemporaryDirectory() as tmp:
                model = str(TINY_MODEL_DIR) if SIZES[size] is None else str(build(Path(tmp) / size, **SIZES[size]))
                console.print(f"[bold]{size}[/bold]: raw engine (own process)")
                raw = raw_engine_in_own_process(model, args.groups, args.n, args.tokens)
                console.print(f"[bold]{size}[/bold]: Generator actor")
                gen = await Generator.as_actor(model, engine_args=engine_args(), weight_store=store_cfg)
                await actor_round(gen, args.groups, args.n, args.tokens)  # warm-up
                start = time.perf_counter()
                tok = await actor_round(gen, args.groups, args.n, args.tokens)
                actor = tok / (time.perf_counter() - start)
                throughput.add_row(size, f"{raw:,.0f}", f"{actor:,.0f}", f"{actor / raw:.2f}")

                weights = load_file(str(Path(model) / "model.safetensors"))
                for mode in SWAP_MODES:
                    records, tokens = [], 0
                    start = time.perf_counter()
                    for r in range(args.rounds):
                        work = asyncio.ensure_future(actor_round(gen, args.groups, args.n, args.tokens))
                        if r % args.every == args.every - 1:
                            version += 1
                            t = time.perf_counter()
                            store.publish(version, weights)  # what the trainer's push_weights does
                            publish_s.append(time.perf_counter() - t)
                            await asyncio.sleep(0.2)  # let the round get under way
                            records.append(await gen.update_weights.call_one(version, mode=mode))
                        tokens += await work
                    wall = time.perf_counter() - start
                    lost = sum(u["pause_s"] + u["drain_wait_s"] for u in records)
                    updates.add_row(
                        size,
                        mode,
                        str(len(records)),
                        f"{statistics.median(u['pause_s'] for u in records):.3f}",
                        f"{statistics.median(u['drain_wait_s'] for u in records):.3f}",
                        f"{statistics.median(u['tokens_in_flight'] for u in records):,.0f}",
                        f"{tokens / wall:,.0f}",
                        f"{lost / wall:.1%}",
                    )
                    console.print(f"  {mode}: {[round(u['pause_s'], 3) for u in records]} s pauses")
                    reloads += [u["pause_s"] for u in records]  # pause, reload_weights, resume
                await stop_actor(gen)
            store.close()
            gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
            pub, rel = statistics.median(publish_s), statistics.median(reloads)
            store_table.add_row(
                size, f"{gb * 1e3:,.0f}", f"{pub:.3f}", f"{gb / pub:.2f}", f"{rel:.3f}", f"{gb / rel:.2f}"
            )
    console.print(throughput)
    console.print(updates)
    console.print(store_table)


if __name__ == "__main__":
    asyncio.run(main())
