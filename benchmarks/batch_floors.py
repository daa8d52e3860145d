"""What one GRPO batch of benchmarks/vs_trl.py costs with no RL framework around it: the floors its step time
is read against.

    .venv/bin/python -m benchmarks.batch_floors [--repeats 3]

The batch: the 83M Qwen3 shape (benchmarks/placement_83m.py), 4 prompts x G=8, exactly 64 new tokens each,
float32, as many threads as this process may use cores. Measured one after the other in one process:

- generate with transformers' `generate` (sampling, min_new_tokens = max_new_tokens = 64): what TRL generates with;
- generate with vLLM's `LLM` in this process (V1 multiprocessing off; the generator's engine arguments on CPU, the
  sampled tokens' logprobs): what forge_rl's generator runs, without the actor;
- train: one forward and backward of the 32 generated rows (the sampled tokens' logprobs, mean over the
  responses) and an AdamW step, in plain transformers + PyTorch, no shared-prompt packing;
- the machine's float32 matmul rate (a 2048 x 768 by 768 x 3072 product), and what the train step's
  6 x parameters x tokens FLOPs take at that rate: no trainer does better.

Each is the mean of `--repeats` runs after one warm-up run.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.vs_trl import GROUP, LR, NEW_TOKENS, PROMPTS, write_prompts


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, oneDNN's kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.mean(times)


def measure(model: Path, prompts_file: Path, repeats: int) -> dict[str, float]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM's import: its engine in this process
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    prompts = [row["prompt"] for row in json.loads(prompts_file.read_text())[:PROMPTS]]
    return {**transformers_figures(model, prompts, repeats), **vllm_figures(model, prompts, repeats)}


def transformers_figures(model: Path, prompts: list[str], repeats: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    batch = tokenizer([p for p in prompts for _ in range(GROUP)], return_tensors="pt", padding=True)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    lengths = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    rows: list[torch.Tensor] = []

    def generate():
        with torch.no_grad():
            rows[:] = [policy.generate(**batch, **sampling, **lengths)]

    figures = dict(hf_generate_s=timed(generate, repeats))
    tokens = rows[0]
    mask = torch.cat([batch["attention_mask"], torch.ones(tokens.shape[0], NEW_TOKENS, dtype=torch.long)], 1)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR)

    def train():
        logits = policy(input_ids=tokens, attention_mask=mask).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        (-logprobs[:, -NEW_TOKENS:].mean()).backward()
        optimizer.step()
        optimizer.zero_grad()

    figures["train_s"] = timed(train, repeats)
    a, b = torch.randn(2048, 768), torch.randn(768, 3072)
    matmul_s = timed(lambda: [a @ b for _ in range(20)], repeats) / 20
    figures["matmul_gflops"] = 2 * 2048 * 768 * 3072 / matmul_s / 1e9
    params = sum(p.numel() for p in policy.parameters())
    figures["train_at_matmul_rate_s"] = 6 * params * tokens.numel() / (figures["matmul_gflops"] * 1e9)
    return figures


def vllm_figures(model: Path, prompts: list[str], repeats: int) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    from forge_rl.actors.generator_engine import CPU_ENGINE_DEFAULTS, ENGINE_DEFAULTS

    args = {**CPU_ENGINE_DEFAULTS, **ENGINE_DEFAULTS, "max_model_len": 256}  # the generator's, as vs_trl runs it
    engine = LLM(str(model), distributed_executor_backend="uni", seed=0, **args)
    sampling = SamplingParams(n=GROUP, max_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, logprobs=0)
    return dict(vllm_generate_s=timed(lambda: engine.generate(prompts, sampling, use_tqdm=False), repeats))


def print_table(figures: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one batch, no framework: {PROMPTS} prompts x G={GROUP} x {NEW_TOKENS} tokens, 83M, fp32")
    table.add_column("what")
    table.add_column("s", justify="right")
    table.add_row("generate: transformers generate (TRL's)", f"{figures['hf_generate_s']:.2f}")
    table.add_row("generate: vLLM LLM in one process (forge_rl's engine)", f"{figures['vllm_generate_s']:.2f}")
    table.add_row("train: transformers forward+backward + AdamW, unpacked", f"{figures['train_s']:.2f}")
    table.add_row(
        f"train at the matmul rate ({figures['matmul_gflops']:.0f} GFLOP/s), 6 x params x tokens",
        f"{figures['train_at_matmul_rate_s']:.2f}",
    )
    Console(width=120).print(table)


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help="an HF model directory (default: the 83M shape, built in a temporary folder)")
    ap.add_argument("--prompts", help="vs_trl's prompts file (default: written from the model's tokenizer)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else None
        if model is None:
            from benchmarks.placement_83m import SHAPE_83M
            from forge_rl.models.build_tiny import build

            model = build(Path(tmp) / "qwen3_83m", **SHAPE_83M)
        prompts = Path(args.prompts) if args.prompts else Path(tmp) / "prompts.json"
        if not args.prompts:
            write_prompts(model, prompts, n=PROMPTS)
        print_table(measure(model, prompts, args.repeats))


if __name__ == "__main__":
    cli()
