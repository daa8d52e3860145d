"""Async vs synchronous GRPO on the same task, config and number of steps, one run after the other.

    .venv/bin/python -m benchmarks.async_vs_sync [--steps 30] [--ages 1,2] [key=value ...]

Workload with stragglers: the reward includes a "slow verifier" whose latency per group is heavy-tailed
(Pareto, alpha 1.5, median ~50 ms, a few groups take seconds), as a sandboxed code check or an LLM judge
would be. In the synchronous loop (async_mode false, max_policy_age 0) every step waits for its slowest
group, then the generator idles while the trainer trains and the weights sync. In the async loop
(max_policy_age 1 and 2) rollout tasks keep generating and scoring while the trainer trains, and the
replay buffer absorbs the stragglers. The tiny model's answers are 2-4 tokens, so completion-length tails
are not simulated here; the verifier latency is the straggler (benchmarks/long_tail.py simulates length tails).

Prints steps/minute (training phase only), the trainer's and the generator's idle fractions, mean batch
staleness, and held-out greedy accuracy (500 prompts) after the same number of steps. Target: async
>= 1.5x the synchronous steps/minute at no worse accuracy.
"""

import argparse
import asyncio
import random
import time

from rich.console import Console
from rich.table import Table

from forge_rl.config import load_config
from forge_rl.recipes.grpo import GRPOConfig, main

VERIFIER_SEED = random.Random(0)


def slow_verifier(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Heavy-tailed latency per group (Pareto alpha 1.5, scale 30 ms, capped at 5 s); contributes 0 reward."""
    time.sleep(min(5.0, 0.03 * VERIFIER_SEED.paretovariate(1.5)))
    return [0.0] * len(completions)


def run_one(config: str, overrides: list[str], label: str) -> dict:
    cfg = load_config(GRPOConfig, config, overrides)
    Console().rule(label)
    return asyncio.run(main(cfg))


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/grpo/tiny.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ages", default="1,2")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    common = [
        f"steps={args.steps}",
        "eval_every=0",
        "checkpoint_every=0",
        "rollout_tasks=16",
        "rewards=[{name: exact_match, weight: 1.0}, {name: format, weight: 0.1}, "
        "{name: 'benchmarks.async_vs_sync:slow_verifier', weight: 0.0}]",
        *args.overrides,
    ]
    runs = [
        (
            "synchronous",
            common + ["async_mode=false", "max_policy_age=0", "output_dir=outputs/bench/sync", "overwrite=true"],
        )
    ]
    for age in args.ages.split(","):
        runs.append(
            (
                f"async, max_policy_age {age}",
                common
                + [
                    "async_mode=true",
                    f"max_policy_age={age}",
                    f"output_dir=outputs/bench/async{age}",
                    "overwrite=true",
                ],
            )
        )
    results = [(label, run_one(args.config, overrides, label)) for label, overrides in runs]
    base = results[0][1]["steps_per_min"]
    table = Table(title=f"GRPO {args.steps} steps, slow heavy-tailed verifier ({args.config})")
    for col in (
        "loop",
        "steps/min",
        "vs sync",
        "trainer idle",
        "generator idle",
        "mean staleness",
        "max staleness",
        "held-out acc before",
        "after",
        "drops",
    ):
        table.add_column(col, justify="right")
    for label, s in results:
        table.add_row(
            label,
            f"{s['steps_per_min']:.1f}",
            f"{s['steps_per_min'] / base:.2f}x",
            f"{s['trainer_idle_fraction']:.0%}",
            f"{s['generator_idle_fraction']:.0%}",
            f"{s['mean_staleness']:.2f}",
            str(s["max_staleness"]),
            f"{s['eval_first']:.1%}",
            f"{s['evals'][-1][-1]:.1%}",
            ", ".join(f"{k}={v}" for k, v in s["drops"].items() if v),
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    cli()
