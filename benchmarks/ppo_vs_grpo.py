"""PPO (a critic, one sample per prompt) against GRPO (a group of 8 per prompt) on the demo task, at equal
training time, one run after the other in one invocation.

    .venv/bin/python -m benchmarks.ppo_vs_grpo [--budget-s 150] [--eval-every 25]

Each run trains from the same warm start (tiny-warm, 38% held-out) with its demo config (configs/grpo/tiny.yaml,
`make demo`; configs/ppo/tiny.yaml, `make demo-ppo`) until `budget-s` seconds of training (start-up and
evaluations excluded), evaluating greedy held-out exact match (500 prompts) every `eval-every` steps. Prints
steps/min, episodes trained and the accuracy curve sampled at fixed training times, and plots accuracy against
training seconds (outputs/bench/ppo_vs_grpo.png). Both runs share this machine's cores with nothing else of
theirs: the critic's forward and backward take time from the policy's on the same cores.
"""

import argparse
import asyncio

from rich.console import Console
from rich.table import Table

from forge_rl.config import load_config
from forge_rl.recipes.algorithm import GRPO
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.ppo import PPO, PPOConfig
from forge_rl.recipes.rl_run import RLRun

RUNS = (
    ("GRPO, G=8 x 16 prompts", GRPO, GRPOConfig, "configs/grpo/tiny.yaml"),
    ("PPO, critic, G=1 x 64 prompts", PPO, PPOConfig, "configs/ppo/tiny.yaml"),
)


async def train_for(run, budget_s: float, eval_every: int) -> dict:
    """Train until `budget_s` seconds of training, evaluating every `eval_every` steps; then finish."""
    async with run:
        await run.evaluate()
        while run.training_s() < budget_s:
            line = await run.rl_step()
            if run.step % eval_every == 0:
                line.update(await run.evaluate())
            if run.step % 10 == 0:
                Console().print(
                    f"  step {run.step}: {run.training_s():.0f} s of training, "
                    f"held-out {run.evals[-1][2]:.1%} at step {run.evals[-1][0]}"
                )
        return await run.finish()


def accuracy_at(evals: list, at_s: float) -> float | None:
    """Held-out accuracy of the newest evaluation made by `at_s` seconds of training."""
    seen = [acc for _, t, acc in evals if t <= at_s + 1e-9]
    return seen[-1] if seen else None


def plot(results: list[tuple[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, s in results:
        ax.plot([t for _, t, _ in s["evals"]], [100 * a for *_, a in s["evals"]], marker="o", label=label)
    ax.set_xlabel("training seconds (start-up and evaluations excluded)")
    ax.set_ylabel("held-out exact match (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", default="outputs/bench/ppo_vs_grpo")
    args = ap.parse_args()
    results = []
    for label, algorithm, schema, config in RUNS:
        Console().rule(label)
        name = algorithm.name.lower()
        cfg = load_config(
            schema, config, ["steps=100000", "eval_every=0", f"output_dir={args.out}/{name}", "overwrite=true"]
        )
        results.append((label, asyncio.run(train_for(RLRun(cfg, algorithm), args.budget_s, args.eval_every))))
    marks = [args.budget_s * f for f in (0.25, 0.5, 0.75)]
    table = Table(title=f"PPO against GRPO on the demo task, {args.budget_s:.0f} s of training each")
    for col in (
        "run",
        "steps",
        "steps/min",
        "episodes trained",
        "held-out at 0 s",
        *[f"at {m:.0f} s" for m in marks],
        "final (last 3)",
        "time to 60%",
    ):
        table.add_column(col, justify="right")
    for label, s in results:
        table.add_row(
            label,
            str(s["steps"]),
            f"{s['steps_per_min']:.1f}",
            str(s["buffer"]["trained"]),
            f"{s['eval_first']:.1%}",
            *[f"{a:.1%}" if (a := accuracy_at(s["evals"], m)) is not None else "-" for m in marks],
            f"{s['eval_last3_mean']:.1%}",
            f"{s['time_to_60']:.0f} s" if s["time_to_60"] is not None else "-",
        )
    Console(width=200).print(table)
    plot(results, f"{args.out}.png")
    Console().print(f"accuracy against training time: {args.out}.png")


if __name__ == "__main__":
    cli()
