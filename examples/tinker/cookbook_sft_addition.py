"""Supervised fine-tuning on 2-digit addition with tinker-cookbook's own SFT training code
(`tinker_cookbook.supervised.train.main`, unchanged) against a Tinker service. Only the data is written here: a JSONL
file of conversations ("a+b=" and its sum), read by the cookbook's `FromConversationFileBuilder`, and the greedy
held-out accuracy of cookbook_rl_addition.py as an evaluator.

    python examples/tinker/cookbook_sft_addition.py --service-json outputs/tinker/service.json [--examples 2000]

Metrics land in --out/metrics.jsonl (the cookbook's: `train_mean_nll` per step, the evaluator's every --eval-every).
"""

import argparse
import asyncio
import json
from pathlib import Path

from cookbook_rl_addition import RENDERER, GreedyAccuracy, connect  # the RL loop's renderer, held-out measure
from rl_addition import problems
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


def write_conversations(path: Path, n: int, seed: int, eval_size: int) -> None:
    """`n` addition conversations, none of them a held-out question."""
    held_out = frozenset(q for q, _ in problems(eval_size, seed=20261202))
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in problems(n, seed, exclude=held_out)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service-json", required=True, help="a forge_rl service's output_dir/service.json")
    parser.add_argument("--examples", type=int, default=2000, help="training conversations (one epoch)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (a full fine-tuning service ignores it)")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="outputs/tinker_cookbook_sft")
    args = parser.parse_args()
    info = connect(parser, args.service_json)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_conversations(out / "addition.jsonl", args.examples, args.seed, args.eval_size)
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=info["model_path"], renderer_name=RENDERER, max_length=64, batch_size=args.batch
    )
    evaluator = GreedyAccuracy(info["model_path"], args.eval_size, max_tokens=8)
    config = train.Config(
        log_path=str(out), model_name=info["model_path"], recipe_name="forge_rl_addition_sft",
        renderer_name=RENDERER, base_url=info["base_url"], lora_rank=args.rank, learning_rate=args.lr,
        dataset_builder=FromConversationFileBuilder(file_path=str(out / "addition.jsonl"), common_config=common),
        evaluator_builders=[lambda: evaluator] if args.eval_size else [], eval_every=args.eval_every, save_every=0,
    )  # fmt: skip
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
