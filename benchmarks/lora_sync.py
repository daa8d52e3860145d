"""LoRA against full fine-tuning: what one policy version costs to publish and to load into vLLM, and the
trainer's memory, side by side on the same model.

    python -m benchmarks.lora_sync [--sizes 83M,0.6B] [--rank 16] [--rounds 3]

For each size a Qwen3-shaped model with random weights and the tiny tokenizer is built into a temporary
directory ("83M": hidden 768, 12 layers, MLP 2304, 12 heads / 4 KV heads; "0.6B": Qwen3-0.6B's hidden 1024,
28 layers, MLP 3072, 16 / 8 heads of 128; the 128-token vocabulary makes it ~0.44B parameters). Then, once
with full fine-tuning and once with LoRA on every decoder linear, a 1-proc trainer actor and a vLLM generator
actor run: a train step (peak RSS of the trainer proc), then `rounds` versions published by the trainer
(`push_weights`) and loaded by the generator (`update_weights`: a weight reload between engine steps, or an
adapter added to the running engine). Prints bytes per version, seconds to publish and to load (median),
and the trainer's peak RSS.
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from forge_rl.actors.generator import Generator
from forge_rl.actors.trainer import Trainer
from forge_rl.actors.trainer_config import OptimizerConfig, TrainerConfig
from forge_rl.runtime import provisioned, stop_actor
from forge_rl.models.build_tiny import build
from forge_rl.models.lora_config import LoRAConfig
from forge_rl.types import TrainBatch

SIZES = {
    "83M": dict(
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    ),
    "0.6B": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}


def make_batch(B: int = 8, T: int = 64) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 128, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, T // 2 :] = True
    return TrainBatch(
        tokens, mask, -torch.rand(B, T, generator=g) * mask, torch.where(mask, 0, -1), torch.randn(B, generator=g)
    )


async def measure(model_dir: str, lora: LoRAConfig, rounds: int, tmp: Path) -> dict:
    async with provisioned():  # a run of its own: its weight store holds only this mode's versions
        return await _measure(model_dir, lora, rounds, tmp)


async def _measure(model_dir: str, lora: LoRAConfig, rounds: int, tmp: Path) -> dict:
    cfg = TrainerConfig(model=model_dir, lora=lora, optim=OptimizerConfig(lr=1e-4), checkpoint_dir=str(tmp / "ckpt"))
    trainer, generator = await asyncio.gather(
        Trainer.options(spmd=True).as_actor(cfg),
        Generator.options(replicas=1).as_service(model_dir, engine_args=dict(max_model_len=128), lora=lora),
    )
    try:
        step = await trainer.step.call_one([make_batch()])
        pushes, loads = [], []
        for version in range(1, rounds + 1):
            pushes.append(await trainer.push_weights.call_one(version))
            start = time.perf_counter()
            await generator.update_weights.call_all(version)
            loads.append(time.perf_counter() - start)
        check = await generator.generate.route([5, 6, 7], n=1, max_tokens=4)  # the engine serves after loading
        assert check[0].policy_versions.eq(rounds).all()
    finally:
        await asyncio.gather(stop_actor(trainer), generator.shutdown())
    return dict(
        bytes=pushes[-1]["bytes"],
        push_s=statistics.median(p["push_s"] for p in pushes),
        load_s=statistics.median(loads),
        peak_rss_mb=step["peak_rss_mb"],
        step_s=step["step_s"],
    )


async def main(sizes: list[str], rank: int, rounds: int) -> None:
    console = Console()
    table = Table(title=f"one policy version: full weights vs a rank-{rank} LoRA adapter (every decoder linear)")
    for col in (
        "model",
        "training",
        "bytes / version",
        "publish s",
        "load into vLLM s",
        "trainer peak RSS MB",
        "train step s",
    ):
        table.add_column(col, justify="right")
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(build(Path(tmp) / size, **SIZES[size]))
            rows = {}
            for name, lora in (("full", LoRAConfig()), ("LoRA", LoRAConfig(rank=rank, alpha=2.0 * rank))):
                console.print(f"{size} {name} ...")
                rows[name] = await measure(model_dir, lora, rounds, Path(tmp) / name)
            for name, r in rows.items():
                table.add_row(
                    size,
                    name,
                    f"{r['bytes'] / 1e6:,.2f} MB",
                    f"{r['push_s']:.3f}",
                    f"{r['load_s']:.3f}",
                    f"{r['peak_rss_mb']:,.0f}",
                    f"{r['step_s']:.2f}",
                )
            full, ad = rows["full"], rows["LoRA"]
            table.add_row(
                size,
                "LoRA / full",
                f"{ad['bytes'] / full['bytes']:.4f}x",
                f"{ad['push_s'] / full['push_s']:.2f}x",
                f"{ad['load_s'] / full['load_s']:.2f}x",
                f"{ad['peak_rss_mb'] / full['peak_rss_mb']:.2f}x",
                f"{ad['step_s'] / full['step_s']:.2f}x",
                end_section=True,
            )
    console.print(table)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="83M,0.6B")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: {unknown} unknown; choose from {list(SIZES)}")
    asyncio.run(main(args.sizes.split(","), args.rank, args.rounds))


if __name__ == "__main__":
    cli()
