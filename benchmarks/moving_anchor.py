"""A KL penalty to a frozen reference against a KL to a moving anchor (reference.follow_every), and no KL, on the
demo task: equal steps, one run after the other in one invocation.

    .venv/bin/python -m benchmarks.moving_anchor [--steps 150] [--kl-coef 0.5] [--follow-every 1] [--follow-lag 1]

Each run trains tiny-warm with the demo's config (configs/grpo/tiny.yaml, `make demo`) for `steps` steps. The frozen
reference is the starting policy; the moving anchor is the policy `follow-lag` versions ago, reloaded from the weight
store every `follow-every` steps while generation and training go on. Prints held-out greedy exact match (first ->
mean of the last three evaluations), the mean KL to the reference over the last 20 steps, the reference versions
used, and steps/min.
"""

import argparse
import asyncio
import statistics
import time

from rich.console import Console
from rich.table import Table

from forge_rl.config import load_config
from forge_rl.observability.metrics import read_jsonl
from forge_rl.recipes.rl_run import RLRun
from forge_rl.recipes.train import train
from forge_rl.recipes.grpo_config import GRPOConfig


def runs(args) -> list[tuple[str, list[str]]]:
    kl = [f"trainer.loss.kl_coef={args.kl_coef}"]
    return [
        ("no KL", []),
        (f"KL {args.kl_coef} to the frozen start", kl),
        (
            f"KL {args.kl_coef} to the policy {args.follow_lag} version(s) ago, reloaded every {args.follow_every} "
            "step(s)",
            kl + [f"reference.follow_every={args.follow_every}", f"reference.follow_lag={args.follow_lag}"],
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kl-coef", type=float, default=0.5)
    parser.add_argument("--follow-every", type=int, default=1)
    parser.add_argument("--follow-lag", type=int, default=1)
    parser.add_argument("--out", default="outputs/bench/moving_anchor")
    args = parser.parse_args()
    table = Table(title=f"KL anchors on the demo task, {args.steps} steps each")
    for column in (
        "run",
        "held-out first -> last 3",
        "KL to the reference (last 20 steps)",
        "reference versions",
        "steps/min",
    ):
        table.add_column(column)
    stamp = time.strftime("%Y%m%d-%H%M%S")  # a folder of its own per invocation
    for i, (name, overrides) in enumerate(runs(args)):
        out = f"{args.out}/{stamp}-{i}"
        cfg = load_config(
            GRPOConfig,
            "configs/grpo/tiny.yaml",
            [f"steps={args.steps}", f"output_dir={out}", "export_dir=null", *overrides],
        )
        Console().print(f"[bold]{name}[/bold] -> {out}")
        summary = asyncio.run(train(RLRun(cfg)))
        rows = [r for r in read_jsonl(f"{out}/metrics.jsonl") if "trainer/loss" in r]
        kl = [r["trainer/kl_ref"] for r in rows[-20:] if "trainer/kl_ref" in r]
        versions = sorted({int(r["reference/version"]) for r in rows if "reference/version" in r})
        table.add_row(
            name,
            f"{summary['eval_first']:.1%} -> {summary['eval_last3_mean']:.1%}",
            f"{statistics.mean(kl):.4f}" if kl and overrides else "-",
            (f"{versions[0]}..{versions[-1]}" if len(versions) > 1 else str(versions[0])) if versions else "-",
            f"{summary['steps_per_min']:.0f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
