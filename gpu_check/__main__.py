"""`make gpu-check`: one command that proves the GPU path, in at most ~10 minutes on one H100.

    python -m gpu_check [--steps 20] [--out outputs/gpu_check] [--cpu-only]

It first says which tiers this host can run and why not the others (gpu_check/tiers.py), then runs them:
1. CPU logic: the CPU tests of the CUDA-only logic (backend, start method, placement, memory plan) — everywhere.
2. no-vLLM (tests/gpu/test_gpu.py, with vLLM made unimportable for every process it starts): a FSDP2 bf16 step of a
   Qwen3-0.6B-shaped model with fp32 master weights over NCCL and its peak GPU memory against the memory plan,
   both publish paths from CUDA, the critic; then the trainer's step against a plain transformers loop at equal work
   at Qwen3-0.6B and -1.7B shapes (benchmarks/trainer.py, its table in OUT/trainer.md). It needs no vLLM, so a host
   with a site PyTorch of another version
   and a wheelhouse install runs it (docs/getting_started.md). Without CUDA it runs on CPU with a small model as
   a logic check of the same code, and says the GPU part did not run.
3. vLLM, where CUDA is visible and vLLM imports with this torch (vLLM pins one torch): vLLM's behaviour logprobs
   against the trainer's bf16 forward (tests/gpu/test_gpu_vllm.py), then GRPO runs of that model (random weights,
   the real vocabulary size) on one GPU, colocated (the engine sleeps while the trainer steps): steps/min, peak
   GPU memory per role (nvidia-smi, sampled), time to sleep, wake and load weights per step, versions advancing,
   staleness held; a LoRA run (adapter swap, and adapters still applied after a wake: the trainer's approx KL to
   the behaviour policy stays at bf16 noise); a PPO run (its critic trained on the same GPU); with 2+ GPUs, the
   same with 2 replicas.
The table goes to the console and to OUT/gpu_check.md (copy it into docs/benchmarks.md with the date and GPU). A
failed test is named in it with the line that failed and what it said; each pytest's and each run's whole output
is kept beside the table (OUT/<tier>.log), and the table names the file.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpu_check.pytest_report import pytest_rows
from gpu_check.tiers import Tier, decide, describe, host_facts

REPO = Path(__file__).resolve().parents[1]
CPU_LOGIC_TESTS = [
    "tests/unit/gpu_check/test_gpu_logic.py",
    "tests/unit/runtime/test_resources.py",
    "tests/integration/test_gpu_placement.py",
    "tests/unit/runtime/test_memory_plan.py",
    "tests/unit/gpu_check/test_gpu_tiers.py",
]
NO_VLLM = REPO / "gpu_check" / "no_vllm"  # first on PYTHONPATH in the no-vLLM tier: `import vllm` fails there
QWEN3_0_6B_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    intermediate_size=3072,
    vocab_size=151936,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
)
# A random-weight model earns no reward: groups are kept (zero advantage) so that every step trains.
GPU_RUN = [
    "generator.engine_args.dtype=bfloat16",
    "generator.engine_args.max_model_len=1024",
    "trainer.dtype=bfloat16",
    "generator.sampling.max_tokens=64",
    "batch_groups=8",
    "group_size=8",
    "buffer.drop_zero_advantage=false",
    "eval_size=64",
    "eval_every=0",
    "resources.placement=colocated",
    "export_dir=null",
]


class GpuMemorySampler(threading.Thread):
    """Peak GPU memory per role from `nvidia-smi --query-compute-apps`, every 0.5 s; a process is named by its
    comm (the provisioner names procs forge:<Role>; vLLM names its engine VLLM::EngineCor)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_mib: dict[str, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.done.wait(0.5):
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            ).stdout
            for line in out.strip().splitlines():
                pid, mib = (x.strip() for x in line.split(","))
                try:
                    role = psutil.Process(int(pid)).name()
                except (psutil.Error, ValueError):
                    continue
                self.peak_mib[role] = max(self.peak_mib.get(role, 0), int(mib))


def grpo_rows(
    name: str,
    model: Path,
    out: Path,
    overrides: list[str],
    recipe: str = "grpo",
    config: str = "configs/grpo/tiny.yaml",
) -> list[tuple[str, str]]:
    """One GRPO run (or another recipe's on its loop: PPO) in a process of its own (a fresh CUDA state), with GPU
    memory sampled per role."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    sampler = GpuMemorySampler()
    sampler.start()
    start = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "forge_rl.recipes",
        recipe,
        "--config",
        config,
        f"model={model}",
        f"output_dir={run_dir}",
        "overwrite=true",
        *GPU_RUN,
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    sampler.done.set()
    log = out / f"{name.replace(' ', '_').replace(',', '')}.log"
    log.write_text(f"$ {' '.join(cmd)}\n(exit {proc.returncode})\n\n{proc.stdout}\n{proc.stderr}")
    if proc.returncode != 0:
        last = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1][-300:]
        return [(name, f"FAILED (exit {proc.returncode}): {last}; whole output: {log.name}")]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "trainer/loss" in r]

    def mean(key: str) -> str:
        values = [r[key] for r in steps[1:] if key in r]  # the first step pays for warm-up
        return f"{sum(values) / len(values):.3f} s" if values else "n/a"

    memory = ", ".join(f"{role} {mib / 1024:.1f} GB" for role, mib in sorted(sampler.peak_mib.items()))
    return [
        (
            f"{name}: steps",
            f"{summary['steps'] - summary['start_step']} in {summary['wall_s']:.0f} s, "
            f"{summary['steps_per_min']:.1f} steps/min (whole command {time.perf_counter() - start:.0f} s)",
        ),
        (
            f"{name}: versions",
            f"trainer {summary['trainer_version']}, generators {summary['generator_versions']}; "
            f"max staleness {summary['max_staleness']}",
        ),
        (f"{name}: peak GPU memory", memory or "nvidia-smi showed no process"),
        (
            f"{name}: per step",
            f"sleep {mean('sync/hold_s')}, wake {mean('sync/release_s')}, publish "
            f"{mean('sync/push_s')}, load into the engine {mean('sync/pause_s')}",
        ),
        (
            f"{name}: loss / mismatch",
            f"final loss {steps[-1]['trainer/loss']:.4f}; train/inference mismatch "
            f"|log pi - log mu| mean {steps[-1]['trainer/mismatch_abs_mean']:.2e}, max "
            f"{steps[-1]['trainer/mismatch_abs_max']:.2e}, KL(mu||pi) k3 "
            f"{steps[-1]['trainer/mismatch_k3']:.2e} (bf16 kernels differ between the engine "
            "and the trainer; staleness adds to it)",
        ),
    ]


def no_vllm_rows(tier: Tier, out: Path) -> list[tuple[str, str]]:
    """The no-vLLM tier in a pytest of its own, vLLM unimportable in it and every proc it starts; its tests add
    their figures (train step, peak memory against the plan, publish, critic) as rows."""
    report = out / "no_vllm_tier.jsonl"
    report.unlink(missing_ok=True)
    env = {
        "FORGE_GPU_CHECK_REPORT": str(report),
        "PYTHONPATH": os.pathsep.join(p for p in (str(NO_VLLM), os.environ.get("PYTHONPATH")) if p),
    }
    if tier.on == "cpu":
        env["FORGE_GPU_TIER_ON_CPU"] = "1"
    where = "on CUDA" if tier.on == "cuda" else "on CPU, a logic check"
    rows = pytest_rows(
        f"no-vLLM tier ({where}; tests/gpu/test_gpu.py)",
        ["-m", "gpu", "tests/gpu/test_gpu.py"],
        out,
        "no_vllm_tier",
        env,
    )
    if report.exists():
        rows += [tuple(json.loads(line)) for line in report.read_text().splitlines()]
    return rows


def trainer_speed_rows(tier: Tier, out: Path) -> list[tuple[str, str]]:
    """forge_rl's trainer step against a plain transformers loop at equal work (benchmarks/trainer.py), Qwen3-0.6B
    and -1.7B shapes on this GPU, vLLM unimportable as in the no-vLLM tier; its table goes to OUT/trainer.md."""
    name = "trainer speed (benchmarks/trainer.py)"
    if tier.on != "cuda":
        return [(name, "NOT RUN: no CUDA device (on a CPU: python -m benchmarks.trainer, minutes on 2 cores)")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(NO_VLLM), os.environ.get("PYTHONPATH")) if p)}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.trainer",
        "--shape",
        "0.6b,1.7b",
        "--plain-dtype",
        "float32,bfloat16",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--out",
        str(out),
        "--models",
        str(out / "models"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    (out / "trainer.log").write_text(proc.stdout + proc.stderr)
    results = out / "trainer.json"
    if proc.returncode or not results.exists():
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return [(name, f"FAILED (exit {proc.returncode}): {last[0]}; whole output in {out / 'trainer.log'}")]
    rows = []
    for r in json.loads(results.read_text()):
        mfu = f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
        rows.append(
            (
                f"trainer speed, {r['shape']}: {r['side']}",
                f"{r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s{mfu}, peak {r['peak_gb']:.1f} GB, "
                f"{r['vs_plain']:.2f}x the plain loop",
            )
        )
    return rows


def vllm_rows(args, facts) -> list[tuple[str, str]]:
    from forge_rl.models.build_tiny import build

    rows = pytest_rows(
        "vLLM tier: logprobs vs the trainer (tests/gpu/test_gpu_vllm.py)",
        ["-m", "gpu", "tests/gpu/test_gpu_vllm.py"],
        args.out,
        "vllm_tier",
    )
    model = build(args.out / "qwen3-0.6b-shape", **QWEN3_0_6B_SHAPE)
    rows += grpo_rows("colocated, 1 GPU", model, args.out, [f"steps={args.steps}"])
    rows += grpo_rows(
        "LoRA colocated, sync",
        model,
        args.out,
        ["steps=5", "trainer.lora.rank=16", "async_mode=false", "max_policy_age=0"],
    )
    # PPO: the critic (a second trained model: value head, AdamW) time-shares the GPU with trainer and engine
    rows += grpo_rows(
        "PPO colocated, critic",
        model,
        args.out,
        ["steps=5", "group_size=1", "batch_groups=32", "rollout_tasks=32", "buffer.capacity=64"],
        recipe="ppo",
        config="configs/ppo/tiny.yaml",
    )
    if facts.cuda_devices >= 2:
        rows += grpo_rows(
            "colocated, 2 replicas", model, args.out, [f"steps={args.steps // 2}", "generator.replicas=2"]
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "outputs/gpu_check")
    ap.add_argument("--cpu-only", action="store_true", help="as if no GPU were visible (the CPU checks alone)")
    args = ap.parse_args()
    facts = host_facts(args.cpu_only)
    tiers = {t.name: t for t in decide(facts)}
    print(describe(facts, list(tiers.values())), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = pytest_rows("CPU tests of the CUDA-only logic", CPU_LOGIC_TESTS, args.out, "cpu_logic")
    if tiers["no-vLLM"].runs:
        rows += no_vllm_rows(tiers["no-vLLM"], args.out)
        rows += trainer_speed_rows(tiers["no-vLLM"], args.out)
    else:  # the install is broken for this torch: a failure, not a host without a GPU
        rows.append(("no-vLLM tier", f"FAILED: {tiers['no-vLLM'].why}"))
    if tiers["vLLM"].runs:
        rows.append(("device", f"{facts.cuda_devices} x {facts.device_name}, torch {facts.torch}, vLLM {facts.vllm}"))
        rows += vllm_rows(args, facts)
    else:
        rows.append(("vLLM tier", f"NOT RUN: {tiers['vLLM'].why}"))
    if not facts.cuda_devices:
        rows.append(
            (
                "GPU part",
                "NOT RUN: "
                + (
                    "--cpu-only was given"
                    if args.cpu_only
                    else "no CUDA device visible (torch.cuda.is_available() is False)"
                ),
            )
        )
    width = max(len(k) for k, _ in rows)
    cells = [(k, v.replace("|", "\\|")) for k, v in rows]  # a `|` in a failure's source line ends a cell
    table = "\n".join(f"| {k:<{width}} | {v} |" for k, v in cells)
    (args.out / "gpu_check.md").write_text(f"| check | result |\n|---|---|\n{table}\n")
    print(table)
    failed = any(v.startswith("FAILED") for _, v in rows)
    if not facts.cuda_devices:
        print("gpu-check: the GPU part was NOT run. Run `make gpu-check` on a machine with an NVIDIA GPU for the rest.")
    print(f"gpu-check: {'FAILED' if failed else 'ok'}; table in {args.out / 'gpu_check.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
