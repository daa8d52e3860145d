"""Sync and async GRPO on long-tailed response lengths, each loop in both placements, in one invocation.

    .venv/bin/python -m benchmarks.long_tail [--steps 30] [--images docs/images] [key=value ...]

Workload: the demo (configs/grpo/tiny.yaml: tiny-warm, G=8 x 16 groups a step, its task and rewards) with every
group's response length drawn from a log-normal like a reasoning model's tail (`generator.lengths`,
forge_rl/loop/lengths.py): median 16 tokens, p99 9x the median (144), at least 8, at most 160. Each response runs
to its length (`ignore_eos`); its answer is the text up to its end-of-sequence token, and the tokens after it are
generated and forwarded by the trainer but out of the loss, so the task learns as in the demo while the engine and
the trainer do the work of long responses. A prompt has its length (keyed by the example), so both loops, which
read the same prompts in the same order, generate the same lengths for them.

A synchronous step waits for the longest of its 16 groups while the engine decodes an emptying batch and the
trainer idles; the asynchronous loop (max_policy_age 1) admits new prompts as groups finish, so the engine's batch
stays full, and trains while the tail finishes. Runs, one after the other in this process: for each placement
(disaggregated: one core per role; colocated: both roles on both cores in turn) the synchronous then the
asynchronous loop, so each pair shares the machine's conditions. Each loop is compared at its best placement.

Prints per run: steps/min (training phase), the trainer's and the engine's idle fractions, the engine's mean
batch occupancy (sequences in it, time-weighted over the time it generated; 128 = all 16 groups of 8),
tokens made after a weight swap mid-sequence (partial rollouts), stale drops and requeued groups, tokens the
trainer forwarded (equal work: both loops train the same prompts), and held-out greedy accuracy before and after.
With --images DIR, the timelines of the best synchronous and the best asynchronous runs are copied there.
"""

import argparse
import asyncio
import json
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from forge_rl.config import load_config
from forge_rl.recipes.grpo import GRPOConfig, main

OUT = Path("outputs/bench/long_tail")
WORKLOAD = [
    "generator.lengths.median=16",
    "generator.lengths.p99_over_median=9",
    "generator.lengths.min_tokens=8",
    "generator.sampling.max_tokens=160",
    "generator.engine_args.max_model_len=192",
]
LOOPS = {"sync": ["async_mode=false", "max_policy_age=0"], "async": ["async_mode=true", "max_policy_age=1"]}


def trained_tokens(out: Path) -> int:
    """Tokens the trainer forwarded over the run (prompts, answers and filler), from its per-step metrics."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return round(sum(m["trainer/tokens_per_s"] * m["trainer/step_s"] for m in lines if "trainer/step_s" in m))


def run(label: str, overrides: list[str]) -> dict:
    out = OUT / label.replace(", ", "_")
    cfg = load_config(GRPOConfig, "configs/grpo/tiny.yaml", overrides + [f"output_dir={out}", "overwrite=true"])
    Console().rule(label)
    summary = asyncio.run(main(cfg))
    return dict(summary, label=label, out=str(out), trained_tokens=trained_tokens(out))


def row(s: dict, best_sync: float) -> list[str]:
    p = s["partial_rollouts"]
    generated = s["generator_stats"]["generated_tokens"]
    return [
        s["label"],
        f"{s['steps_per_min']:.1f}",
        f"{s['steps_per_min'] / best_sync:.2f}x",
        f"{s['trainer_idle_fraction']:.0%}",
        f"{s['generator_idle_fraction']:.0%}",
        f"{s['mean_running_sequences']:.0f}",
        f"{p['swapped_tokens']:,} ({p['swapped_tokens'] / max(generated, 1):.1%})",
        f"{s['drops'].get('stale', 0)}",
        f"{p['requeued_groups']}",
        f"{s['trained_tokens'] / 1e6:.2f}M",
        f"{s['eval_first']:.1%} -> {s['evals'][-1][-1]:.1%}",
    ]


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--placements", default="disaggregated,colocated")
    ap.add_argument("--images", default=None, help="copy the best sync and async timelines here")
    ap.add_argument("overrides", nargs="*", help="apps.grpo.main overrides for every run")
    args = ap.parse_args()
    common = [
        f"steps={args.steps}",
        "eval_every=0",
        "eval_size=200",
        "checkpoint_every=0",
        "export_dir=null",
        *WORKLOAD,
        *args.overrides,
    ]
    results = [
        run(f"{loop}, {where}", common + mode + [f"resources.placement={where}"])
        for where in args.placements.split(",")
        for loop, mode in LOOPS.items()
    ]
    best = {
        loop: max((s for s in results if s["label"].startswith(loop)), key=lambda s: s["steps_per_min"])
        for loop in LOOPS
    }
    table = Table(
        title=f"GRPO {args.steps} steps, long-tailed response lengths (median 16, p99 144 tokens), "
        "tiny-warm, G=8 x 16 groups"
    )
    for col in (
        "loop, placement",
        "steps/min",
        "vs best sync",
        "trainer idle",
        "engine idle",
        "engine occupancy",
        "tokens after a swap mid-sequence",
        "stale drops",
        "requeued",
        "tokens trained",
        "held-out",
    ):
        table.add_column(col, justify="right")
    for s in results:
        table.add_row(*row(s, best["sync"]["steps_per_min"]))
    Console(width=220).print(table)
    print(
        f"best async / best sync: {best['async']['steps_per_min'] / best['sync']['steps_per_min']:.2f}x "
        f"({best['async']['label']} against {best['sync']['label']})"
    )
    (OUT / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if args.images:
        for loop, s in best.items():
            shutil.copyfile(Path(s["out"]) / "timeline.png", Path(args.images) / f"long_tail_{loop}_timeline.png")


if __name__ == "__main__":
    cli()
