"""A reward model's groups/s as an actor (requests batched across groups) against the same model inside a Python
reward function (each reward worker loads it and scores one group per call), side by side in one run.

    .venv/bin/python -m benchmarks.reward_model [--model forge_rl/models/tiny_rm] [--groups 256] [--group-size 8]
                                                [--concurrency 16]

Both score the same groups through the RewardActor, `concurrency` groups in flight at a time, as concurrent
rollouts do. Without --model, a one-label classifier with tiny-warm's body and a random score head is built
(the cost is the forward's, not the head's).
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from forge_rl.actors.reward import RewardActor, RewardSpec
from forge_rl.actors.reward_model import RewardModel
from forge_rl.data.arithmetic import training_problems
from forge_rl.runtime import provisioned

_LOADED = {}  # in a reward worker: path -> (tokenizer, model), loaded on its first call


def classifier_in_function(prompts: list[str], completions: list[str], model: str, **_) -> list[float]:
    """The reward model as a plain reward function: one group, one forward, in the reward worker's process."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if model not in _LOADED:
        _LOADED[model] = (AutoTokenizer.from_pretrained(model),
                          AutoModelForSequenceClassification.from_pretrained(model).eval())
    tok, net = _LOADED[model]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                     tokenize=False) for p, c in zip(prompts, completions)]
    with torch.no_grad():
        logits = net(**tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)).logits
    return torch.sigmoid(logits[:, 0]).tolist()


def random_classifier(out: Path) -> Path:
    from transformers import Qwen3ForSequenceClassification

    from forge_rl.models import resolve_model_path

    base = Path(resolve_model_path("tiny-warm"))
    model = Qwen3ForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((base / name).read_bytes())
    return out


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
    rows = []
    async with provisioned():
        function = await RewardActor.options(mesh_name="in_function").as_actor(
            [RewardSpec("benchmarks.reward_model:classifier_in_function", args={"model": model})], 300.0)
        rows.append(("in a reward function (its workers, a forward per group)",
                     await groups_per_s(function, groups, concurrency), "-"))
        rm = await RewardModel.as_actor(model, 64, 10.0)
        spec = RewardSpec(model=model)
        actor = await RewardActor.options(mesh_name="as_actor").as_actor([spec], 300.0, models={spec.name: rm})
        rate = await groups_per_s(actor, groups, concurrency)
        stats = await rm.stats.call_one()
        rows.append(("as a RewardModel actor (batched across groups)", rate,
                     f"{stats['mean_batch']:.1f} sequences per forward"))
    return rows


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    problems = training_problems(args.groups, seed=1)
    groups = [([p.question] * args.group_size, [str(int(p.answer) + d) for d in range(args.group_size)])
              for p in problems]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(random_classifier(Path(tmp) / "rm"))
        rows = asyncio.run(measure(model, groups, args.concurrency))
    base = rows[0][1]
    table = Table(title=f"reward model throughput: {args.groups} groups of {args.group_size}, "
                        f"{args.concurrency} in flight ({args.model or 'tiny-warm body, random head'})")
    for col in ("scored", "groups/s", "vs function", "batching"):
        table.add_column(col, justify="right")
    for label, rate, note in rows:
        table.add_row(label, f"{rate:.1f}", f"{rate / base:.2f}x", note)
    Console(width=160).print(table)


if __name__ == "__main__":
    cli()
