"""Sync and async GRPO, each side by side (disaggregated) and time-shared (colocated), on an 83M-parameter model.

    .venv/bin/python -m benchmarks.placement_83m [--steps 6] [key=value ...]

Issue 17's workload: a Qwen3-shaped model of 83M parameters (hidden 768, 12 layers, 12 heads, 4 KV heads,
MLP 2304, random init, the tiny model's character tokenizer), G=8, 4 groups per step, 64 new tokens
(`ignore_eos`: every response is exactly 64 tokens, so every step and both loops do the same work), the
zero-advantage filter off (a random model earns almost no reward: the steps still do all their work). On the 2-core
CPU machine generation and training
each take seconds per step, so where the roles' time goes decides the loop's speed. Each run is
apps/grpo/main.py in this process, one after the other (per placement, sync then async); prints steps/min
(training phase), the trainer's and the generator's idle fractions, the stale drops, each run against the best
synchronous one, and where async's extra work goes: tokens generated per token trained (groups generated but
never trained: stale, or still in flight or buffered at the end), tokens whose KV cache a weight swap threw
away (recompute_kv), and the time the engine spent paused for swaps; then where each run's step went on its
critical path (step_time/<part>, mean over the steps after the first). Each run's timeline.png is in its output
folder.

The baseline is the synchronous loop as a user would run it best. Pinned one core per role (disaggregated)
each role idles while the other works; colocated, each role gets both cores in turn. On two shared cores with
compute-bound roles, colocated sync already keeps both cores busy, so async can only win back the little time
neither role computes (weight push, scheduling): expect async ~1.0x the best sync here, and a real gain only
where roles have hardware of their own (more cores, GPUs). Issue 17's target was 1.2x.
"""

import argparse
import asyncio
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from forge_rl.config import load_config
from forge_rl.models.build_tiny import build
from forge_rl.observability.metrics import read_jsonl
from forge_rl.recipes.grpo import GRPOConfig, main

SHAPE_83M = dict(
    hidden_size=768,
    intermediate_size=2304,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
)


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--placements", default="disaggregated,colocated")
    ap.add_argument(
        "--async-swap-modes",
        default="recompute_kv",
        help="one async run per generator.swap_mode (keep_kv: no KV recomputed at a swap)",
    )
    ap.add_argument("overrides", nargs="*", help="apps.grpo.main overrides for every run")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "qwen3_83m", **SHAPE_83M)
        common = [
            f"model={model}",
            f"steps={args.steps}",
            "group_size=8",
            "batch_groups=4",
            "rollout_tasks=8",
            "generator.sampling.max_tokens=64",
            "generator.sampling.ignore_eos=true",
            "generator.engine_args.max_model_len=256",
            "buffer.drop_zero_advantage=false",
            "eval_every=0",
            "eval_size=8",
            "checkpoint_every=0",
            "no_batch_timeout_s=900",
            *args.overrides,
        ]
        sync, asynchronous = ["async_mode=false", "max_policy_age=0"], ["async_mode=true", "max_policy_age=1"]
        modes = args.async_swap_modes.split(",")
        loops = [("sync", sync)] + [
            ("async" if m == "recompute_kv" else f"async {m}", asynchronous + [f"generator.swap_mode={m}"])
            for m in modes
        ]
        runs = [
            (f"{loop}, {where}", mode + [f"resources.placement={where}"])
            for where in args.placements.split(",")  # sync then async per placement: each set shares conditions
            for loop, mode in loops
        ]
        for label, extra in runs:
            Console().rule(label)
            out = f"output_dir=outputs/bench/placement_83m/{label.replace(', ', '_').replace(' ', '_')}"
            cfg = load_config(GRPOConfig, "configs/grpo/tiny.yaml", common + extra + [out, "overwrite=true"])
            summary = asyncio.run(main(cfg))
            results.append((label, dict(summary, breakdown=step_breakdown(Path(cfg.output_dir) / "metrics.jsonl"))))
    # the baseline: the faster of the two synchronous placements, as a user would set sync up
    base = max(s["steps_per_min"] for label, s in results if label.startswith("sync"))
    table = Table(title=f"GRPO on an 83M-parameter Qwen3 shape, {args.steps} steps, G=8 x 4 groups x 64 tokens")
    for col in (
        "loop",
        "steps/min",
        "s/step",
        "vs best sync",
        "trainer idle",
        "generator idle",
        "stale drops",
        "generated / trained",
        "recomputed at swaps",
        "swap pauses",
    ):
        table.add_column(col, justify="right")
    for label, s in results:
        g = s["generator_stats"]
        trained = args.steps * 4 * 8 * 64  # every response is 64 tokens
        evaluated = 2 * 8 * 64  # the evaluations before and after: 8 prompts, 64 tokens each
        table.add_row(
            label,
            f"{s['steps_per_min']:.2f}",
            f"{60 / s['steps_per_min']:.1f}",
            f"{s['steps_per_min'] / base:.2f}x",
            f"{s['trainer_idle_fraction']:.0%}",
            f"{s['generator_idle_fraction']:.0%}",
            f"{s['stale_fraction']:.1%}",
            f"{(g['generated_tokens'] - evaluated) / trained:.2f}",
            f"{g['recomputed_tokens_total']:,} tokens",
            f"{g['pause_s_total']:.1f} s",
        )
    Console(width=160).print(table)
    Console(width=160).print(breakdown_table(results))


def step_breakdown(metrics: Path) -> dict[str, float]:
    """Mean seconds per step_time/<part> over the run's steps after the first (its warm-up)."""
    rows = [r for r in read_jsonl(metrics) if "step_time/wall" in r]
    rows = rows[1:] or rows
    return {k.removeprefix("step_time/"): sum(r[k] for r in rows) / len(rows) for k in rows[0] if "step_time/" in k}


def breakdown_table(results: list[tuple[str, dict]]) -> Table:
    parts = list(results[0][1]["breakdown"])
    table = Table(title="where a step went on its critical path, mean s over steps 2..N (step_time/<part>)")
    for col in ("loop", *parts):
        table.add_column(col, justify="right")
    for label, s in results:
        table.add_row(label, *(f"{s['breakdown'].get(p, 0.0):.2f}" for p in parts))
    return table


if __name__ == "__main__":
    cli()
