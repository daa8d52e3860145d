"""A reward model's groups/s as an actor (requests batched across groups) against the same model inside a Python
reward function (each reward worker loads it and scores one group per call), side by side in one run.

    .venv/bin/python -m benchmarks.reward_model [--model tiny-rm | --shape 83m] [--groups 256] [--group-size 8]
                                                [--concurrency 16]

Every row scores the same groups through a RewardActor, `concurrency` groups in flight at a time, as concurrent
rollouts do:

- in a reward function, as written: each of the pool's workers (forge_rl/rewards/workers.py) loads the model and
  runs one forward per group with torch's default threads (one per core, in every worker at once);
- in a reward function, tuned: the same with the cores split between the workers (torch.set_num_threads);
- as a RewardModel actor with batching off (max_batch = one group, no window): one forward per group, one proc;
- as a RewardModel actor, batched: the groups that arrive within batch_window_ms run as one forward.

The model is the shipped tiny-rm unless --model names another HF sequence classifier; --shape 83m builds an
83M-parameter Qwen3 classifier with random weights (benchmarks/placement_83m.py's shape), where a forward is
dearer than the call around it.
"""

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from forge_rl.actors.reward import RewardActor
from forge_rl.rewards.reward_config import RewardConfig
from forge_rl.actors.reward_model import RewardModel
from forge_rl.data.arithmetic import training_problems
from forge_rl.models import resolve_model_path
from forge_rl.rewards.workers import default_reward_workers
from forge_rl.runtime import provisioned

_LOADED = {}  # in a reward worker: path -> (tokenizer, model), loaded on its first call


def classifier_in_function(
    prompts: list[str], completions: list[str], model: str, threads: int = 0, **_
) -> list[float]:
    """The reward model as a plain reward function: one group, one forward, in the reward worker's process.
    `threads`: torch threads in this worker (0: torch's default, one per core)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if model not in _LOADED:
        if threads:
            torch.set_num_threads(threads)
        _LOADED[model] = (
            AutoTokenizer.from_pretrained(model),
            AutoModelForSequenceClassification.from_pretrained(model).eval(),
        )
    tok, net = _LOADED[model]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False)
        for p, c in zip(prompts, completions)
    ]
    with torch.no_grad():
        logits = net(**tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)).logits
    return (logits[:, 0] if logits.shape[1] == 1 else torch.softmax(logits, -1)[:, 1]).tolist()  # as the actor does


def classifier_83m(out: Path) -> str:
    """An 83M-parameter Qwen3 sequence classifier (one label) with random weights and the tiny tokenizer."""
    from transformers import Qwen3ForSequenceClassification

    from benchmarks.placement_83m import SHAPE_83M
    from forge_rl.models.build_tiny import build

    base = build(out / "lm", **SHAPE_83M)
    model = Qwen3ForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=0)
    model.save_pretrained(out / "rm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / "rm" / name).write_bytes((Path(base) / name).read_bytes())
    return str(out / "rm")


async def groups_per_s(reward, groups: list[tuple[list[str], list[str]]], concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(prompts, completions):
        async with gate:
            await reward.score.call_one(prompts, completions, ["stop"] * len(completions))

    # warm-up, not timed: every reward worker has loaded the model and made its first forward
    await asyncio.gather(*(one(p, c) for p, c in groups[:concurrency]))
    start = time.perf_counter()
    await asyncio.gather(*(one(p, c) for p, c in groups))
    return len(groups) / (time.perf_counter() - start)


async def measure(model: str, groups, concurrency: int) -> list[tuple[str, float, str]]:
    rows, workers, group = [], default_reward_workers(), len(groups[0][1])
    split = max(1, (os.cpu_count() or 1) // workers)
    async with provisioned():
        for label, threads in (("as written", 0), (f"tuned: {split} thread(s) per worker", split)):
            function = await RewardActor.options(mesh_name=f"in_function_{threads}").as_actor(
                [
                    RewardConfig(
                        "benchmarks.reward_model:classifier_in_function", args={"model": model, "threads": threads}
                    )
                ],
                600.0,
                workers,
            )
            rows.append(
                (
                    f"in a reward function, {label}",
                    await groups_per_s(function, groups, concurrency),
                    f"{workers} workers, a model and a forward per group in each",
                )
            )
        for label, max_batch, window_ms in (("batching off", group, 0.0), ("batched across groups", 64, 10.0)):
            rm = await RewardModel.options(mesh_name=f"rm_{max_batch}").as_actor(model, max_batch, window_ms)
            spec = RewardConfig(model=model)
            actor = await RewardActor.options(mesh_name=f"as_actor_{max_batch}").as_actor(
                [spec], 600.0, models={spec.name: rm}
            )
            rate = await groups_per_s(actor, groups, concurrency)
            stats = await rm.stats.call_one()
            rows.append(
                (f"as a RewardModel actor, {label}", rate, f"1 proc, {stats['mean_batch']:.1f} sequences per forward")
            )
    return rows


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-rm", help="an HF sequence classifier (default: the shipped tiny-rm)")
    ap.add_argument("--shape", choices=["83m"], default=None, help="a random-weight classifier of this size instead")
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    problems = training_problems(args.groups, seed=1)
    groups = [
        ([p.question] * args.group_size, [str(int(p.answer) + d) for d in range(args.group_size)]) for p in problems
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = classifier_83m(Path(tmp)) if args.shape else resolve_model_path(args.model)
        rows = asyncio.run(measure(model, groups, args.concurrency))
    base = rows[0][1]
    table = Table(
        title=f"reward model throughput: {args.groups} groups of {args.group_size}, {args.concurrency} "
        f"in flight ({args.shape or args.model}, {os.cpu_count()} cores)"
    )
    for col in ("scored", "groups/s", "vs function as written", "how"):
        table.add_column(col, justify="right")
    for label, rate, note in rows:
        table.add_row(label, f"{rate:.1f}", f"{rate / base:.2f}x", note)
    Console(width=180).print(table)


if __name__ == "__main__":
    cli()
