"""forge_rl's GRPO against TRL's `GRPOTrainer` at equal work, on the 83M-parameter Qwen3 shape, in one invocation.

    .venv/bin/python -m benchmarks.vs_trl [--steps 6] [--rounds 1] [--trl-python /work/trl-venv/bin/python]
        [--mode async|sync] [--placement colocated|disaggregated] [key=value ...]

Both sides train the same HF model directory (built here: benchmarks/placement_83m.py's shape, random init, the
tiny model's character tokenizer) on the same prompts (the arithmetic task's training stream from seed 0, as a
chat turn), G=8 samples per prompt, 4 prompts per step, exactly 64 new tokens per sample (forge_rl: ignore_eos;
TRL: min_new_tokens=64 with max_completion_length=64), temperature 1.0, AdamW lr 1e-4 (betas 0.9/0.999, eps 1e-8,
no weight decay, constant rate, no warm-up), grad clip 1.0, no activation checkpointing, clipped loss 0.2/0.28
averaged per sequence then over the batch (forge_rl normalize=sequence_mean; TRL loss_type="grpo"), advantages
scaled by the group's std, no KL term, one optimizer step per batch, float32, rewards exact_match (1.0) + format
(0.1), zero-advantage groups kept.

What differs: TRL generates with transformers' `generate` in its training process and trains there (one process,
both cores); forge_rl generates with vLLM in a generator actor and trains with TorchTitan in a trainer actor
(`--placement`, `--mode`: the asynchronous loop may train a batch one version old, the synchronous never). TRL
takes the prompts in order too (shuffle_dataset=False). TRL recomputes the old policy's logprobs only when it reuses a
batch (here never), forge_rl's trainer takes the engine's. forge_rl's trainer runs each group's shared prompt
once (shared-prompt packing, forge_rl/data/prompt_packing.py: the same logprobs and gradients for fewer FLOPs);
TRL runs every row whole. Random weights earn almost no reward: the runs do all the
work, they learn nothing.

TRL runs in its own environment (its pins differ from this project's), given by `--trl-python`. Made with:
    python3 -m venv /work/trl-venv && /work/trl-venv/bin/pip install trl
Installing this project's CPU build of torch there first (`pip install` its wheel, then trl) gives both sides the same
torch; docs/benchmarks.md names the versions each figure was measured with.

Each round runs forge_rl then TRL (sides alternate, as the machine may be shared); s/step is the mean over the steps
after the first (warm-up: compilation, allocator), tokens/s = 4 x 8 x 64 generated tokens per step / s/step, the
ratio = TRL's s/step / forge_rl's (above 1: forge_rl is faster). forge_rl's step breakdown (step_time/<part>) is
printed beside it. What the same batch costs with no framework around it (each side's engine, a plain training step,
the machine's matmul rate): benchmarks/batch_floors.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUP, PROMPTS, NEW_TOKENS, LR = 8, 4, 64, 1e-4
TRL_VENV_HINT = "python3 -m venv /work/trl-venv && /work/trl-venv/bin/pip install trl"
REPO = Path(__file__).resolve().parent.parent


# ---- the TRL side (runs under --trl-python: imports nothing of forge_rl but its reward functions) -------------


def trl_side(model: str, prompts_file: str, steps: int, out: str, seed: int) -> None:
    """TRL's GRPOTrainer on the model and prompts; writes each step's end time (perf_counter) and versions to `out`."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from forge_rl.rewards.exact_match import exact_match
    from forge_rl.rewards.format import digits_format

    def format_reward(prompts, completions, **kwargs):  # every completion is cut at 64 tokens: "length"
        return digits_format(prompts, completions, finish_reason=["length"] * len(completions))

    rows = json.loads(Path(prompts_file).read_text())
    data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(Path(out).parent / "trl_out"),
        per_device_train_batch_size=GROUP * PROMPTS,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        shuffle_dataset=False,
        gradient_checkpointing=False,  # forge_rl's trainer keeps its activations too
        reward_weights=[1.0, 0.1],
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[exact_match, format_reward],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    start = time.perf_counter()
    trainer.train()
    versions = dict(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__)
    Path(out).write_text(json.dumps(dict(start=start, ends=ends, versions=versions, threads=torch.get_num_threads())))


def run_trl(trl_python: str, model: Path, prompts_file: Path, steps: int, seed: int, tmp: Path) -> dict:
    out = tmp / f"trl_{time.time_ns()}.json"
    cmd = [trl_python, "-m", "benchmarks.vs_trl", "--side", "trl", "--model", str(model)]
    cmd += ["--prompts", str(prompts_file), "--steps", str(steps), "--out", str(out), "--seed", str(seed)]
    # TRL's environment has no forge_rl installed: the repository on its path gives it the reward functions
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    subprocess.run(cmd, check=True, cwd=tmp, env={**os.environ, "PYTHONPATH": path})
    result = json.loads(out.read_text())
    times = [b - a for a, b in zip([result["start"], *result["ends"]], result["ends"])]
    return dict(step_s=times, versions=result["versions"], threads=result["threads"])


# ---- the forge_rl side (this process) ----------------------------------------------------------------------


def run_forge(model: Path, steps: int, mode: str, placement: str, overrides: list[str], out: Path) -> dict:
    import asyncio

    from forge_rl.config import load_config
    from forge_rl.observability.metrics import read_jsonl
    from forge_rl.recipes.grpo import GRPOConfig, main

    loop = ["async_mode=true", "max_policy_age=1"] if mode == "async" else ["async_mode=false", "max_policy_age=0"]
    args = [
        f"model={model}",
        f"steps={steps}",
        f"group_size={GROUP}",
        f"batch_groups={PROMPTS}",
        "rollout_tasks=8",
        f"generator.sampling.max_tokens={NEW_TOKENS}",
        "generator.sampling.ignore_eos=true",
        "generator.engine_args.max_model_len=256",
        "buffer.drop_zero_advantage=false",
        f"trainer.optim.lr={LR}",
        "eval_every=0",
        "eval_size=8",
        "checkpoint_every=0",
        "no_batch_timeout_s=900",
        f"resources.placement={placement}",
        *loop,
        f"output_dir={out}",
        "overwrite=true",
        *overrides,
    ]
    cfg = load_config(GRPOConfig, str(REPO / "configs/grpo/tiny.yaml"), args)
    asyncio.run(main(cfg))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "step_time/wall" in r]
    after_first = rows[1:] or rows  # the first step warms up (compilation, allocator)
    parts = {k: [r[k] for r in after_first] for k in rows[0] if k.startswith("step_time/")}
    return dict(step_s=[r["step_time/wall"] for r in rows], parts={k: statistics.mean(v) for k, v in parts.items()})


# ---- both, and the table -----------------------------------------------------------------------------------


def write_prompts(model: Path, path: Path, n: int) -> None:
    """The task's training prompts in order, as chat turns rendered by the model's template (forge_rl's stream)."""
    from transformers import AutoTokenizer

    from forge_rl.data.arithmetic import chat_prompt, training_problems

    tok = AutoTokenizer.from_pretrained(model)
    rows = [dict(prompt=chat_prompt(tok, p), answer=p.answer) for p in training_problems(n, seed=0)]
    path.write_text(json.dumps(rows))


def mean_after_first(times: list[float]) -> float:
    return statistics.mean(times[1:] if len(times) > 1 else times)


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="forge_rl then TRL, this many times")
    ap.add_argument("--trl-python", default="/work/trl-venv/bin/python", help="the python of TRL's environment")
    ap.add_argument("--mode", choices=("async", "sync"), default="async")
    ap.add_argument("--placement", choices=("colocated", "disaggregated"), default="colocated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--side", choices=("both", "trl"), default="both", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="forge_rl config overrides (key=value)")
    args = ap.parse_args()
    if args.side == "trl":
        return trl_side(args.model, args.prompts, args.steps, args.out, args.seed)
    if not Path(args.trl_python).is_file():
        sys.exit(f"--trl-python {args.trl_python} does not exist: create TRL's environment with `{TRL_VENV_HINT}`")
    compare(args)


def compare(args) -> None:
    from rich.console import Console
    from rich.table import Table

    from benchmarks.placement_83m import SHAPE_83M
    from forge_rl.models.build_tiny import build

    forge_times, trl_times, parts = [], [], []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build(tmp / "qwen3_83m", **SHAPE_83M)
        prompts = tmp / "prompts.json"
        write_prompts(model, prompts, n=PROMPTS * (args.steps + 4))
        for r in range(args.rounds):
            Console().rule(f"round {r + 1}: forge_rl GRPO ({args.mode}, {args.placement})")
            out = REPO / "outputs/bench/vs_trl" / f"forge_round{r + 1}"
            forge = run_forge(model, args.steps, args.mode, args.placement, args.overrides, out)
            forge_times.append(mean_after_first(forge["step_s"]))
            parts.append(forge["parts"])
            Console().rule(f"round {r + 1}: TRL GRPOTrainer")
            trl = run_trl(args.trl_python, model, prompts, args.steps, args.seed, tmp)
            trl_times.append(mean_after_first(trl["step_s"]))
    tokens = GROUP * PROMPTS * NEW_TOKENS
    forge_s, trl_s = statistics.mean(forge_times), statistics.mean(trl_times)
    table = Table(
        title=f"GRPO, 83M Qwen3 shape, {PROMPTS} prompts x G={GROUP} x {NEW_TOKENS} tokens, {args.steps} steps"
    )
    for col in ("side", "s/step (per round)", "s/step", "generated tokens/s", "vs TRL"):
        table.add_column(col, justify="right")
    table.add_row(
        f"forge_rl ({args.mode}, {args.placement})",
        ", ".join(f"{t:.2f}" for t in forge_times),
        f"{forge_s:.2f}",
        f"{tokens / forge_s:.0f}",
        f"{trl_s / forge_s:.2f}x",
    )
    versions = trl["versions"]
    table.add_row(
        f"TRL {versions['trl']} (transformers {versions['transformers']}, torch {versions['torch']})",
        ", ".join(f"{t:.2f}" for t in trl_times),
        f"{trl_s:.2f}",
        f"{tokens / trl_s:.0f}",
        "1.00x",
    )
    Console(width=160).print(table)
    mean_parts = {k.removeprefix("step_time/"): statistics.mean(p[k] for p in parts) for k in parts[0]}
    Console().print(
        "forge_rl's step, mean s over steps 2..N (step_time/<part>): "
        + ", ".join(f"{k} {v:.2f}" for k, v in mean_parts.items())
    )


if __name__ == "__main__":
    cli()
