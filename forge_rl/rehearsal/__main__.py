"""Rehearse a config's trainer (or PPO's critic, or its reference policy) at full size on this CPU machine: each of
its W ranks runs the
Trainer's own code with fake tensors and a fake process group (forge_rl/rehearsal), and each phase's memory per
rank is printed beside the memory plan's.

    python -m forge_rl.rehearsal --config configs/grpo/qwen3_32b.yaml                      # Qwen3-32B, 32 ranks
    python -m forge_rl.rehearsal --config configs/grpo/qwen3_32b.yaml --model Qwen3-8B \\
        trainer_procs=8 trainer.parallel.dp_shard=8 trainer.parallel.tp=1                  # Qwen3-8B, 8 ranks
    python -m forge_rl.rehearsal --config configs/grpo/qwen3_32b.yaml --critic             # PPO's critic
    python -m forge_rl.rehearsal --config configs/grpo/qwen3_32b.yaml --reference          # the KL reference
    python -m forge_rl.rehearsal --config configs/grpo/smolvlm_2b.yaml --model SmolVLM-Instruct \
        task.source=rows.jsonl trainer_procs=32 trainer.parallel.dp_shard=32              # a VLM, 32 ranks

The model's shape is a published Qwen3's (forge_rl/runtime/memory_plan.py QWEN3_SHAPES) or vision-language model's
(forge_rl/rehearsal/vision.py VISION_SHAPES: its train rows carry an image); its checkpoint is a sparse
safetensors file with a real header and no data. The train step is one micro-batch per rank (trainer.micro_batch_size
sequences of generator.engine_args.max_model_len tokens, half prompt, nothing shared to pack): gradients accumulate
in place, so more micro-batches hold no more. `--ranks 0,1` measures some ranks only (every rank still runs the
first pass, which records what the ranks tell each other). Results: docs/benchmarks.md.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

from forge_rl.config import ConfigError, load_config
from forge_rl.recipes.grpo_checks import check_moe
from forge_rl.rehearsal.bounds import findings, phase_plan
from forge_rl.rehearsal.run import Rehearsal, rehearse
from forge_rl.rehearsal.sparse_checkpoint import hf_config, write_sparse_checkpoint
from forge_rl.rehearsal.vision import VISION_SHAPES
from forge_rl.runtime.memory_plan import QWEN3_SHAPES

SHAPES = QWEN3_SHAPES | VISION_SHAPES

GB = 1e9


def spec_of(args, model_dir: Path):
    from dataclasses import replace

    from forge_rl.recipes.ppo_config import PPOConfig

    cfg = load_config(PPOConfig, args.config, [*args.overrides, "model=rehearsal"])
    # Keep Routing is rehearsed off: its batches' routes are the engine's (none here), and what it adds is small next
    # to a step's memory (int64 top-k ids per layer for a micro-batch's tokens on the device during a forward)
    trainer = replace(cfg.trainer, model=str(model_dir), keep_routing=False)
    return cfg, Rehearsal(
        model_dir,
        trainer,
        world=cfg.trainer_procs,
        role=role_of(args),
        seq_len=int(cfg.generator.engine_args.get("max_model_len") or 4096),
        ranks=[int(r) for r in args.ranks.split(",")] if args.ranks else None,
    )


def decoder_layers(shape: dict) -> int:
    """The language model's layers (a vision-language model's tower keeps its own)."""
    return shape.get("text_config", shape)["num_hidden_layers"]


def role_of(args) -> str:
    return "critic" if args.critic else "reference" if args.reference else "trainer"


def summary(result, plan, spec) -> str:
    """Per phase: rank 0 (it writes what the others send) and the largest of the others, in GB."""
    rows = [
        "| phase | rank 0 peak GB (before) | other ranks' peak GB, max (before) | largest tensor made | "
        "largest host block MB | plan GB |",
        "|---|---|---|---|---|---|",
    ]
    for phase in next(iter(result.ranks.values())):
        zero = result.ranks.get(0, {}).get(phase)
        others = [p[phase] for r, p in result.ranks.items() if r != 0]
        top = max(others, key=lambda m: m.peak_bytes) if others else None
        largest = max((p[phase] for p in result.ranks.values()), key=lambda m: m.largest.nbytes)
        cell = lambda m: f"{m.peak_bytes / GB:.2f} ({m.before_bytes / GB:.2f})" if m else "-"  # noqa: E731
        host = max(p[phase].host_block for p in result.ranks.values())
        rows.append(
            f"| {phase} | {cell(zero)} | {cell(top)} | {largest.largest.nbytes / GB:.3f} GB "
            f"{largest.largest.dtype} {list(largest.largest.shape)} | {host / 2**20:.0f} | "
            f"{plan.bytes[phase] / GB:.2f} |"
        )
    return "\n".join(rows)


def run_at(args, layers: int | None):
    """(config, spec, hf config, result) of one rehearsal with `layers` decoder layers (None: the model's)."""
    from dataclasses import replace

    hf = hf_config(SHAPES[args.model], layers)
    with tempfile.TemporaryDirectory(prefix="rehearse-model-") as tmp:
        model_dir = write_sparse_checkpoint(Path(tmp), hf)
        cfg, spec = spec_of(args, model_dir)
        check_moe(replace(cfg, model=args.model), str(model_dir))  # what a run refuses, the rehearsal does too
        p, start = cfg.trainer.parallel, time.time()
        print(
            f"{args.model} {spec.role}, {decoder_layers(hf)} layers, {spec.world} ranks "
            f"(dp_shard {p.dp_shard} x tp {p.tp}), {cfg.trainer.dtype} compute, micro-batch "
            f"{cfg.trainer.micro_batch_size} x {spec.seq_len} tokens, activation checkpointing "
            f"{p.activation_checkpointing}, publish block {cfg.trainer.publish_block_mb} MB",
            flush=True,
        )
        result = rehearse(
            spec, progress=lambda r, n: print(f"  pass {n} rank {r} ({time.time() - start:.0f} s)", flush=True)
        )
    return cfg, spec, hf, result


def extrapolated(results: list, layers: list[int], to: int):
    """The first result with each rank's byte counts taken from the straight line through the runs at `layers`
    decoder layers to `to` layers (a layer adds the same bytes to every phase: its states, its activations)."""
    from dataclasses import replace

    (a, la), (b, lb) = zip(results, layers)
    line = lambda x, y: round(x + (y - x) * (to - la) / (lb - la))  # noqa: E731
    out = replace(a, ranks={})
    for rank, phases in a.ranks.items():
        out.ranks[rank] = {
            name: replace(
                m,
                before_bytes=line(m.before_bytes, b.ranks[rank][name].before_bytes),
                peak_bytes=line(m.peak_bytes, b.ranks[rank][name].peak_bytes),
                after_bytes=line(m.after_bytes, b.ranks[rank][name].after_bytes),
                largest=max(m.largest, b.ranks[rank][name].largest, key=lambda t: t.nbytes),
            )
            for name, m in phases.items()
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m forge_rl.rehearsal", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", choices=sorted(SHAPES), default="Qwen3-32B")
    ap.add_argument(
        "--layers",
        default="",
        help="decoder layers (default: the model's); two, e.g. 2,4: run both "
        "and extrapolate each rank's bytes to the model's layers",
    )
    roles = ap.add_mutually_exclusive_group()
    roles.add_argument("--critic", action="store_true", help="PPO's critic instead of the policy's trainer")
    roles.add_argument(
        "--reference",
        action="store_true",
        help="the reference policy (KL penalty, distillation teacher): load, score, follow",
    )
    ap.add_argument("--ranks", default="", help="comma-separated ranks to measure (default all)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()
    start, layers = time.time(), [int(n) for n in args.layers.split(",") if n]
    try:
        runs = [run_at(args, n) for n in layers or [None]]
    except ConfigError as e:
        sys.exit(f"error: {e}")
    cfg, spec, hf, result = runs[0]
    full = decoder_layers(SHAPES[args.model])
    if len(layers) == 2:
        result = extrapolated([r[3] for r in runs], layers, full)
        print(f"\nextrapolated from {layers[0]} and {layers[1]} layers to {full}")
    plan = phase_plan(hf_config(SHAPES[args.model]), spec.cfg, spec.world, spec.seq_len, role=spec.role)
    print("\n| rank | phase | before GB | peak GB | plan GB | largest tensor made | where | host block MB |")
    print("|---|---|---|---|---|---|---|---|")
    for rank, phases in sorted(result.ranks.items()):
        for phase, m in phases.items():
            print(
                f"| {rank} | {phase} | {m.before_bytes / GB:.2f} | {m.peak_bytes / GB:.2f} | "
                f"{plan.bytes[phase] / GB:.2f} | {m.largest.nbytes / GB:.3f} GB {m.largest.dtype} "
                f"{list(m.largest.shape)} | {m.largest.where} | {m.host_block / 2**20:.0f} |"
            )
    print("\n" + summary(result, plan, spec))
    problems = findings(result, plan)
    if spec.ranks is not None:  # some ranks only: what the others wrote is missing by design
        problems = [p for p in problems if p.startswith("rank ")]
    print(f"\n{len(problems)} findings" + "".join(f"\n- {p}" for p in problems[:40]))
    print(f"(total {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
