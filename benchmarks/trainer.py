"""The trainer's step against the step a user writes by hand, same model, batch and loss, side by side.

    python -m benchmarks.trainer                       # CPU: hidden 512, 4 layers, Qwen3's 151,936 vocabulary (90M)
    python -m benchmarks.trainer --shape 0.6b,1.7b     # GPU: Qwen3-0.6B and -1.7B shapes, 16 x 2,048 tokens
    python -m benchmarks.trainer --out DIR             # also DIR/trainer.md (the table) and DIR/trainer.json

Both sides train a random-weight Qwen3 of the shape (an HF directory written once) on one batch of random tokens,
the first quarter of each row prompt, the rest response, with GRPO's clipped objective against behaviour logprobs
that are the model's own (so the step trains: ratio 1, nothing clipped), AdamW, gradient clipping at 1.0:

- plain: one process, transformers' `Qwen3ForCausalLM` (SDPA attention), fp32 parameters under bf16 autocast (or
  bf16 parameters: `--plain-dtype bfloat16`), logprobs from `F.cross_entropy` over fp32 logits, the clipped loss in
  five lines, fused AdamW. What a user writes in an afternoon, set up as well as it can be.
- forge_rl: the `Trainer` actor on one proc (TorchTitan's Qwen3, fp32 masters under bf16 compute, the fused lm_head),
  called by the controller as a run calls it; its time includes the call.

Each side runs `--warmup` steps, then `--steps` timed steps (the mean is reported); on a CPU the sides take their
steps in turn (a plain step, a forge_rl step, ...), so that the load of a shared machine falls on both alike.
tokens/s counts every token of the
batch. MFU = (6 N + 6 L T d) FLOPs per token / the device's dense bf16 peak (forge_rl/observability/mfu.py: N the
matmul parameters, the lm_head's included, L layers, T the sequence length, d the attention width; the peak from
the datasheet table, or on a CPU or an unknown GPU a measured bf16 matmul rate), the same count for both sides.
Peak memory: the GPU's peak reserved, or on a CPU the process's peak RSS.
"""

import argparse
import asyncio
import gc
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from forge_rl.actors.trainer import Trainer, peak_rss_mb
from forge_rl.actors.trainer_config import OptimizerConfig, TrainerConfig
from forge_rl.observability.mfu import device_peak_flops, mfu
from forge_rl.runtime import provisioned, stop_actor
from forge_rl.types import TrainBatch

VOCAB = 151936
_QWEN3 = dict(
    vocab_size=VOCAB, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True
)
# shape: (HF config, sequences, sequence length, micro-batch); the GPU shapes' micro-batches fit the plain loop's
# fp32 logits (and their copies) on an 80 GB H100
SHAPES = {
    "cpu": (
        dict(
            _QWEN3,
            hidden_size=512,
            num_hidden_layers=4,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=512,
        ),
        8,
        256,
        4,
    ),
    "0.6b": (
        dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16),
        16,
        2048,
        4,
    ),
    "1.7b": (
        dict(_QWEN3, hidden_size=2048, num_hidden_layers=28, intermediate_size=6144, num_attention_heads=16),
        16,
        2048,
        2,
    ),
}
CLIP_LOW, CLIP_HIGH, LR = 0.2, 0.28, 1e-6  # forge_rl's GRPO defaults; a small lr keeps the batch on-policy


@dataclass
class Side:
    name: str
    step_s: float
    peak_gb: float
    grad_norm: float


def make_model_dir(shape: str, root: Path) -> Path:
    from forge_rl.models.build_tiny import MODEL_CONFIG, build_tokenizer, save_random_model

    out = root / f"qwen3-{shape}-shape"
    if not (out / "model.safetensors").exists():
        save_random_model(out, {**MODEL_CONFIG, **SHAPES[shape][0]}, dict(eos_token_id=2, pad_token_id=0))
        build_tokenizer().save(str(out / "tokenizer.json"))
    return out


def make_batch(B: int, T: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, T // 4 :] = True
    tokens = torch.randint(3, VOCAB, (B, T), generator=g)
    return TrainBatch(tokens, mask, torch.zeros(B, T), torch.where(mask, 0, -1), torch.randn(B, generator=g))


def plain_logprobs(model, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log pi(token t | tokens < t) [B, T-1], as a user writes it."""
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(tokens).logits[:, :-1]
    B, n, V = logits.shape
    return -F.cross_entropy(logits.float().reshape(B * n, V), tokens[:, 1:].reshape(B * n), reduction="none").view(B, n)


class PlainLoop:
    """transformers + PyTorch: the clipped GRPO objective, mean over each sequence's tokens, then over sequences."""

    def __init__(self, model_dir: Path, batch: TrainBatch, micro: int, device: torch.device, param_dtype: torch.dtype):
        from transformers import Qwen3ForCausalLM

        self.model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=param_dtype, attn_implementation="sdpa").to(
            device
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)
        self.tokens, self.mask = batch.tokens.to(device), batch.response_mask[:, 1:].to(device)
        self.adv, self.micro, self.device = batch.advantages.to(device), micro, device
        with torch.no_grad():  # behaviour logprobs: the model's own
            self.old = torch.cat(
                [
                    plain_logprobs(self.model, self.tokens[i : i + micro], torch.bfloat16)
                    for i in range(0, len(self.tokens), micro)
                ]
            )
        self.grad_norm = 0.0

    async def step(self) -> float:
        B = len(self.tokens)
        _sync(self.device)
        start = time.perf_counter()
        for lo in range(0, B, self.micro):
            rows = slice(lo, lo + self.micro)
            ratio = (plain_logprobs(self.model, self.tokens[rows], torch.bfloat16) - self.old[rows]).exp()
            a = self.adv[rows, None]
            per_token = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
            m = self.mask[rows]
            ((per_token * m).sum(1) / m.sum(1)).sum().div(B).backward()
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - start

    def peak_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device) / 2**30
        return peak_rss_mb() / 1024  # this process's

    async def close(self) -> None:
        del self.model, self.opt
        gc.collect()


class ForgeRLTrainer:
    """The Trainer actor on one proc, called as a run calls it (its time includes the call); behaviour logprobs from
    its own `logprobs` endpoint."""

    async def start(
        self, model_dir: Path, batch: TrainBatch, micro: int, profile_step: int | None, profile_dir: Path | None
    ) -> "ForgeRLTrainer":
        profile = dict(profile_steps=[profile_step], profile_dir=str(profile_dir)) if profile_dir else {}
        cfg = TrainerConfig(
            model=str(model_dir), dtype="bfloat16", micro_batch_size=micro, optim=OptimizerConfig(lr=LR), **profile
        )
        self.trainer = await Trainer.options(procs=1, spmd=True).as_actor(cfg)
        own = await self.trainer.logprobs.call_one(batch)
        self.batch = TrainBatch(
            batch.tokens, batch.response_mask, own * batch.response_mask, batch.policy_versions, batch.advantages
        )
        self.metrics = {}
        return self

    async def step(self) -> float:
        start = time.perf_counter()
        self.metrics = await self.trainer.step.call_one([self.batch])
        if "profile/summary" in self.metrics:
            Console(width=200).print(f"[dim]{self.metrics['profile/summary']}[/dim]")
        return time.perf_counter() - start

    @property
    def grad_norm(self) -> float:
        return self.metrics["grad_norm"]

    def peak_gb(self) -> float:
        return self.metrics.get("peak_cuda_reserved_mb", self.metrics["peak_rss_mb"]) / 1024

    async def close(self) -> None:
        await stop_actor(self.trainer)


async def timed(sides: dict, steps: int, warmup: int, alternate: bool) -> list[Side]:
    """Each side's mean step time after `warmup` steps: side after side, or (`alternate`) a step of each in turn,
    so that a shared machine's load falls on both alike."""
    times = {name: [] for name in sides}
    rounds = (
        [list(sides)] * (warmup + steps) if alternate else [[name] for name in sides for _ in range(warmup + steps)]
    )
    for round_ in rounds:
        for name in round_:
            times[name].append(await sides[name].step())
    out = []
    for name, side in sides.items():
        kept = times[name][warmup:]
        out.append(Side(name, sum(kept) / len(kept), side.peak_gb(), side.grad_norm))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def run_shape(shape: str, args, root: Path) -> list[dict]:
    _, B, T, micro = SHAPES[shape]
    B, T, micro = args.batch or B, args.seq or T, args.micro or micro
    model_dir = make_model_dir(shape, root)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    params = _parameter_count(model_dir)
    batch = make_batch(B, T)
    Console().print(
        f"[dim]{shape}: {params / 1e6:.1f}M parameters, {B} x {T} tokens, micro-batch {micro}, {device.type}[/dim]"
    )
    plain = {
        f"plain ({d} params, bf16 autocast)" if d == "float32" else f"plain ({d} params)": getattr(torch, d)
        for d in args.plain_dtype.split(",")
    }
    profile = args.out / f"profile-{shape}" if args.profile and args.out else None
    alternate = device.type == "cpu"  # a shared CPU's load falls on both sides alike; a GPU runs one side at a time
    sides = []
    if alternate:
        loops = {name: PlainLoop(model_dir, batch, micro, device, dtype) for name, dtype in plain.items()}
        loops["forge_rl"] = await ForgeRLTrainer().start(model_dir, batch, micro, args.warmup + args.steps, profile)
        try:
            sides = await timed(loops, args.steps, args.warmup, alternate=True)
        finally:
            for loop in loops.values():
                await loop.close()
    else:
        for name, dtype in plain.items():
            loop = PlainLoop(model_dir, batch, micro, device, dtype)
            sides += await timed({name: loop}, args.steps, args.warmup, alternate=False)
            await loop.close()
        loop = await ForgeRLTrainer().start(model_dir, batch, micro, args.warmup + args.steps, profile)
        try:
            sides += await timed({"forge_rl": loop}, args.steps, args.warmup, alternate=False)
        finally:
            await loop.close()
    for side in sides:
        Console().print(f"[dim]{side.name}: {side.step_s:.3f} s/step[/dim]")
    (peak, peak_source), tokens = device_peak_flops(device), B * T
    full_hf = json.loads((model_dir / "config.json").read_text())
    plain_s = sides[0].step_s
    return [
        dict(
            shape=shape,
            side=s.name,
            params_m=params / 1e6,
            tokens=tokens,
            step_s=s.step_s,
            tokens_per_s=tokens / s.step_s,
            grad_norm=s.grad_norm,
            peak_gb=s.peak_gb,
            mfu=mfu(full_hf, tokens, T, s.step_s, peak),
            peak_tflops=peak / 1e12,
            peak_source=peak_source,
            vs_plain=plain_s / s.step_s,
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
            torch=torch.__version__,
        )
        for s in sides
    ]


def _parameter_count(model_dir: Path) -> int:
    """The checkpoint's parameters, the tied lm_head once."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k != "lm_head.weight")


def markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | side | s/step | tokens/s | MFU | peak GB | grad norm | vs plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        used = f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {r['shape']} ({r['params_m']:.0f}M) | {r['side']} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {used} | {r['peak_gb']:.1f} | {r['grad_norm']:.3f} | "
            f"{r['vs_plain']:.2f}x |"
        )
    r = rows[0]
    peak = f"MFU against {r['peak_tflops']:.3g} TFLOP/s dense bf16 ({r['peak_source']})"
    return "\n".join(lines) + f"\n\n{r['device']}, torch {r['torch']}; {peak}\n"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help="cpu, 0.6b, 1.7b (comma-separated); default: 0.6b on a GPU, else cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=0, help="sequences per step (0: the shape's)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (0: the shape's)")
    ap.add_argument("--micro", type=int, default=0, help="sequences per micro-batch (0: the shape's)")
    ap.add_argument("--plain-dtype", default="float32", help="the plain loop's parameter dtypes (float32,bfloat16)")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler trace of forge_rl's last step (--out)")
    ap.add_argument("--models", type=Path, default=None, help="where the random-weight model directories are kept")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    shapes = (args.shape or ("0.6b" if torch.cuda.is_available() else "cpu")).split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.models or Path(tmp)
        async with provisioned():
            for shape in shapes:
                rows += await run_shape(shape, args, root)
    table = Table(title="trainer step: forge_rl against a plain transformers loop, same model, batch and loss")
    for col in ("shape", "side", "s/step", "tokens/s", "MFU", "peak GB", "grad norm", "vs plain"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["shape"],
            r["side"],
            f"{r['step_s']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{100 * r['mfu']:.1f}%",
            f"{r['peak_gb']:.1f}",
            f"{r['grad_norm']:.3f}",
            f"{r['vs_plain']:.2f}x",
        )
    Console(width=160).print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "trainer.md").write_text(markdown(rows))
        (args.out / "trainer.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
