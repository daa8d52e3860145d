"""`make demo`'s GRPO against the hand-written single-process loop, side by side in one run.

    .venv/bin/python -m benchmarks.demo_vs_plain [--steps 150] [--out outputs/demo_vs_plain] [-- key=value ...]

Runs benchmarks/plain_grpo.py and apps/grpo/main.py (configs/grpo/tiny.yaml, plus any overrides after
`--`) one after the other, each in its own process with the same steps, prompts, rewards and
hyperparameters, and prints: steps/min, training seconds to reach 60% held-out (evaluations excluded on
both sides), accuracy at equal training time, mean of the last three evaluations, and the wall time of
the whole command (start-up and evaluations included). Ratios are forge_rl / plain (time ratios: lower
is better). Issue 17's targets: time to 60% <= 0.8x, steps/min >= 1.25x.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as f:
        subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def accuracy_at(evals: list, seconds: float) -> float:
    """The last evaluation at or before `seconds` of training."""
    return [acc for _, t, acc in evals if t <= seconds + 1e-9][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default="outputs/demo_vs_plain")
    ap.add_argument("overrides", nargs="*", help="apps.grpo.main overrides, e.g. resources.placement=colocated")
    args = ap.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"plain loop ({args.steps} steps) ...", flush=True)
    plain_wall = timed(
        [sys.executable, "-m", "benchmarks.plain_grpo", "--steps", str(args.steps), "--out", str(out / "plain.json")],
        out / "plain.log",
    )
    plain = json.loads((out / "plain.json").read_text())
    print(f"forge_rl demo ({args.steps} steps) ...", flush=True)
    forge_wall = timed(
        [
            sys.executable,
            "-m",
            "apps.grpo.main",
            "--config",
            "configs/grpo/tiny.yaml",
            f"steps={args.steps}",
            f"output_dir={out / 'forge_rl'}",
            "overwrite=true",
            *args.overrides,
        ],
        out / "forge_rl.log",
    )
    forge = json.loads((out / "forge_rl" / "summary.json").read_text())
    forge["train_s"] = forge["wall_s"]
    equal = min(plain["train_s"], forge["train_s"])

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "-"

    def secs(x):
        return f"{x:.0f} s" if x is not None else "never"

    rows = [
        (
            "steps/min (training)",
            f"{plain['steps_per_min']:.1f}",
            f"{forge['steps_per_min']:.1f}",
            ratio(forge["steps_per_min"], plain["steps_per_min"]),
        ),
        (
            "training time to 60% held-out",
            secs(plain["time_to_60"]),
            secs(forge["time_to_60"]),
            ratio(forge["time_to_60"], plain["time_to_60"]),
        ),
        (
            f"accuracy at {equal:.0f} s of training",
            f"{accuracy_at(plain['evals'], equal):.1%}",
            f"{accuracy_at(forge['evals'], equal):.1%}",
            "",
        ),
        ("held-out, mean of last 3 evals", f"{plain['eval_last3_mean']:.1%}", f"{forge['eval_last3_mean']:.1%}", ""),
        ("whole command (start-up, evals)", secs(plain_wall), secs(forge_wall), ratio(forge_wall, plain_wall)),
    ]
    if "stale_fraction" in forge:
        rows.append(("stale drops (of generated)", "0", f"{forge['stale_fraction']:.2%}", ""))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':{width}} | {'plain loop':>12} | {'forge_rl':>12} | ratio")
    for name, a, b, r in rows:
        print(f"{name:{width}} | {a:>12} | {b:>12} | {r}")
    print(f"\nforge_rl placement: {forge.get('placement', '?')}; logs and summaries in {out}")
    (out / "table.json").write_text(
        json.dumps(dict(rows=rows, plain_wall_s=plain_wall, forge_wall_s=forge_wall), indent=2)
    )


if __name__ == "__main__":
    main()
