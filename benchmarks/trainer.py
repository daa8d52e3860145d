"""Trainer throughput: the Monarch trainer actor vs a plain single-process PyTorch loop, side by side.

    python -m benchmarks.trainer [--sizes tiny,small] [--steps 8] [--batch 32] [--seq 64]

For each model size, the same batch and the same GRPO loss are trained (1) in a plain loop in this process
(TorchTitan's Qwen3, AdamW, clipping: what you would write by hand), (2) by the trainer actor on 1 proc,
(3) FSDP2 on 2 procs and (4) TP on 2 procs (gloo on CPU). Prints tokens/s per step after warm-up, the ratio
to the plain loop, and peak RSS per rank. "small" is a random char-level Qwen3 (hidden 512, 8 layers, ~25M
parameters) built into a temporary directory; "tiny" is the embedded model.
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

from forge_rl.actors.trainer import (
    OptimizerConfig, ParallelConfig, Trainer, TrainerConfig, _peak_rss_mb,
)
from forge_rl.runtime import provisioned, stop_actor
from forge_rl.losses.grpo import GRPOLossConfig, per_token_loss, reduce_loss
from forge_rl.losses.logprobs import token_logprobs
from forge_rl.models import TINY_MODEL_DIR
from forge_rl.types import TrainBatch

SIZES = {
    "tiny": None,
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}


def make_batch(B: int, T: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, T // 4 :] = True
    return TrainBatch(torch.randint(3, 128, (B, T), generator=g), mask, -torch.rand(B, T, generator=g) * mask,
                      torch.where(mask, 0, -1), torch.randn(B, generator=g))


def plain_loop(model_dir: str, batch: TrainBatch, steps: int, warmup: int) -> list[float]:
    from forge_rl.models.qwen3 import build_model

    model, _ = build_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    cfg, B, n = GRPOLossConfig(), batch.num_sequences, batch.num_response_tokens
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        logprobs, _ = token_logprobs(model(batch.tokens), batch.tokens)
        loss, _ = per_token_loss(logprobs, batch.behaviour_logprobs, batch.advantages, cfg)
        reduce_loss(loss, batch.response_mask, cfg.normalize, B, n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


async def actor_run(model_dir: str, batch: TrainBatch, steps: int, warmup: int, procs: int, dp: int, tp: int):
    cfg = TrainerConfig(model=model_dir, parallel=ParallelConfig(dp_shard=dp, tp=tp), optim=OptimizerConfig(lr=1e-5))
    trainer = await Trainer.options(procs=procs, spmd=True).as_actor(cfg)
    half = batch.num_sequences // dp
    batches = [TrainBatch(batch.tokens[r * half : (r + 1) * half], batch.response_mask[r * half : (r + 1) * half],
                          batch.behaviour_logprobs[r * half : (r + 1) * half],
                          batch.policy_versions[r * half : (r + 1) * half], batch.advantages[r * half : (r + 1) * half])
               for r in range(dp)]
    times, rss = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()  # what the controller sees: RPC, pickling and the step itself
        metrics = await trainer.train_step.call(batches)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    rss = [m["peak_rss_mb"] for _, m in metrics.items()]
    await stop_actor(trainer)
    return times, rss


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    batch = make_batch(args.batch, args.seq)
    tokens = batch.tokens.numel()
    table = Table(title=f"trainer step, batch {args.batch} x {args.seq} tokens, median of {args.steps} steps")
    for col in ("model", "params", "setup", "step s", "tokens/s", "vs plain", "peak RSS per rank (MiB)"):
        table.add_column(col, justify="right")
    async with provisioned():
        for size in args.sizes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = str(TINY_MODEL_DIR)
                if SIZES[size] is not None:
                    from forge_rl.models.build_tiny import build

                    model_dir = str(build(Path(tmp) / size, **SIZES[size]))
                from forge_rl.models.qwen3 import build_model

                params = sum(p.numel() for p in build_model(model_dir)[0].parameters())
                plain = statistics.median(plain_loop(model_dir, batch, args.steps, args.warmup))
                plain_rss = _peak_rss_mb()  # this process's, which also holds the model for the params count
                table.add_row(size, f"{params / 1e6:.1f}M", "plain loop, 1 process", f"{plain:.3f}",
                              f"{tokens / plain:,.0f}", "1.00", f"{plain_rss:,.0f} (this process)")
                for name, procs, dp, tp in (("actor, 1 proc", 1, 1, 1), ("FSDP2, 2 procs", 2, 2, 1),
                                            ("TP, 2 procs", 2, 1, 2)):
                    times, rss = await actor_run(model_dir, batch, args.steps, args.warmup, procs, dp, tp)
                    step = statistics.median(times)
                    table.add_row(size, f"{params / 1e6:.1f}M", name, f"{step:.3f}", f"{tokens / step:,.0f}",
                                  f"{plain / step:.2f}", ", ".join(f"{r:,.0f}" for r in rss))
                    Console().print(f"[dim]{size} {name}: {step:.3f} s/step[/dim]")
    Console(width=160).print(table)


if __name__ == "__main__":
    asyncio.run(main())
