"""Peak memory of one GRPO train step at Qwen3's 151,936-token vocabulary: the full log-softmax the trainer
used first, blockwise logprobs from whole logits, blockwise logprobs with the lm_head fused in, and
loss-parallel logprobs from each tensor-parallel rank's vocabulary shard of the logits (TP 2, gloo).

    .venv/bin/python -m benchmarks.logprob_memory [--batch 8] [--seq 256] [--vocab 151936]

A random-init Qwen3-shaped model (small hidden size, Qwen3's vocabulary: the logits dominate, as they do
for a real model at long sequences) runs forward, per-token logprobs and entropy, the GRPO loss and
backward, once per variant, each variant in a fresh process. Prints the peak RSS the step added (VmHWM
after the step minus RSS before it) and checks that every variant gives the same loss and gradients. The
TP variant splits only the lm_head over the ranks (the logits are what it is about; the small decoder runs
whole on both), its peak is the larger rank's, and its gradients are compared on the decoder layers (the
tied embedding's gradient is split between the ranks there).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from forge_rl.losses.config import LossConfig
from forge_rl.losses.grpo import per_token_loss, reduce_loss
from forge_rl.losses.fused_head import hidden_logprobs
from forge_rl.losses.logprobs import VocabShard, token_logprobs

TP = 2


def full_log_softmax(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer did before: fp32 log-softmax over the whole vocabulary, entropy always."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, tokens[:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    pad = torch.zeros_like(tokens[:, :1], dtype=picked.dtype)
    return torch.cat([pad, picked], 1), torch.cat([pad, entropy], 1)


def rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ranks (a column-parallel layer's input)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


def one_step(variant: str, batch: int, seq: int, vocab: int, out: str, rank: int = 0, init: str = "") -> None:
    """Runs in its own process: build the model, measure one step, save loss + gradients."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1 if variant == "tp" else 2)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=seq,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[:, seq // 2 :] = True
    behaviour = -torch.rand(batch, seq, generator=g) * mask
    advantages = torch.randn(batch, generator=g)
    before = rss_mb("VmRSS")
    if variant == "fused":  # the trainer's path when the lm_head is whole on its rank
        hidden = model.model(tokens).last_hidden_state
        logprobs, entropy = hidden_logprobs(hidden, model.lm_head.weight, tokens, entropy="detached")
    elif variant == "tp":  # the trainer's path under TP: this rank's vocabulary shard of the logits
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=TP)
        shard = VocabShard.of(dist.group.WORLD, vocab)
        hidden = _SumGradOverRanks.apply(model.model(tokens).last_hidden_state)
        chunk = -(-vocab // TP)
        local_logits = hidden @ model.lm_head.weight[shard.start : shard.start + chunk].T
        logprobs, entropy = token_logprobs(local_logits, tokens, entropy="detached", shard=shard)
        del local_logits
    else:
        logits = model(tokens).logits
        if variant == "full":
            logprobs, entropy = full_log_softmax(logits, tokens)
        else:
            logprobs, entropy = token_logprobs(logits, tokens, entropy="detached")
        del logits
    token_loss, _ = per_token_loss(logprobs, behaviour, advantages, LossConfig(), entropy=entropy)
    loss = reduce_loss(token_loss, mask, "sequence_mean", batch, int(mask.sum()))
    loss.backward()
    peak = rss_mb("VmHWM") - before
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if variant == "tp":
        grads = {n: g for n, g in grads.items() if ".layers." in n}
        peak = torch.tensor(peak)
        dist.all_reduce(peak, dist.ReduceOp.MAX)
        peak = float(peak)
        dist.destroy_process_group()
        if rank:
            return
    torch.save(dict(loss=loss.item(), peak_mb=peak, grads=grads), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return one_step(args.variant, args.batch, args.seq, args.vocab, args.out, args.rank, args.init)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("full", "chunked", "fused", "tp"):
            out = f"{tmp}/{variant}.pt"
            cmd = [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--out",
                out,
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--vocab",
                str(args.vocab),
                "--init",
                f"{tmp}/init",
            ]
            ranks = [subprocess.Popen([*cmd, "--rank", str(r)]) for r in range(TP if variant == "tp" else 1)]
            if any(p.wait() for p in ranks):
                raise SystemExit(f"variant {variant} failed")
            results[variant] = torch.load(out)
    full = results["full"]
    logits_gb = args.batch * args.seq * args.vocab * 4 / 1e9
    print(
        f"one GRPO train step, batch {args.batch} x {args.seq} tokens, vocab {args.vocab} "
        f"(fp32 logits: {logits_gb:.2f} GB per copy), CPU, peak RSS added by the step:"
    )
    summary = dict(full_gib=full["peak_mb"] / 1024)
    for variant, label in (
        ("full", "full log-softmax (first)"),
        ("chunked", "blockwise from logits"),
        ("fused", "blockwise, lm_head fused"),
        ("tp", f"loss parallel, TP {TP} (per rank)"),
    ):
        r = results[variant]
        grad_gap = max((full["grads"][n] - r["grads"][n]).abs().max().item() for n in r["grads"])
        print(
            f"  {label:32s} {r['peak_mb'] / 1024:6.2f} GiB ({r['peak_mb'] / full['peak_mb']:.2f}x)  "
            f"loss {r['loss']:.8f}  max gradient difference {grad_gap:.1e}"
        )
        summary.update(
            {
                f"{variant}_gib": r["peak_mb"] / 1024,
                f"{variant}_ratio": r["peak_mb"] / full["peak_mb"],
                f"{variant}_grad_gap": grad_gap,
                f"{variant}_loss_gap": abs(full["loss"] - r["loss"]),
            }
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
