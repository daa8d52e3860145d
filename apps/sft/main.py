"""Supervised fine-tuning: prompts + target responses -> cross-entropy on the response tokens, on the
TorchTitan trainer actor (FSDP2 / TP over the procs given), with greedy held-out evaluation through a vLLM
generator service.

    python -m apps.sft.main --config configs/sft/tiny.yaml [key=value ...]

Data: `dataset: arithmetic` generates "a+b=" -> "c" problems in code (held-out questions excluded); or a
path to a local .jsonl file or HF dataset directory (see forge_rl/data/jsonl.py and docs/sft.md).
Outputs in output_dir: config.yaml, metrics.jsonl (one line per step and per evaluation), loss.png,
summary.json; DCP checkpoints in trainer.checkpoint_dir (resume=true continues from the newest); an HF
export in export_dir at the end. Ctrl-C saves a checkpoint of the current step and exits.
"""

import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from forge_rl.actors.trainer import OptimizerConfig, Trainer, TrainerConfig
from forge_rl.config import ConfigError, parse_args, to_yaml
from forge_rl.controller.launcher import LauncherConfig
from forge_rl.controller.signals import handle_stop_signals
from forge_rl.data.jsonl import SFTExample, load_sft_dataset, tokenize_messages
from forge_rl.models import resolve_model_path
from forge_rl.observability import MetricsLogger, plot_run
from forge_rl.observability.plots import SFT_PANELS
from forge_rl.types import Completion, Episode, TrainBatch


def _default_trainer() -> TrainerConfig:
    return TrainerConfig(loss="sft", optim=OptimizerConfig(lr=1e-3), checkpoint_dir="${output_dir}/checkpoints")


@dataclass
class SFTConfig:
    model: str = "tiny"  # "tiny", "tiny-warm" or a local HF model directory
    dataset: str = "arithmetic"  # "arithmetic" (generated in code) or a local .jsonl file / HF dataset directory
    seed: int = 0  # data order (arithmetic stream / epoch shuffles)
    steps: int = 300  # optimizer steps in total (a resumed run continues up to this)
    batch_size: int = 256  # sequences per step, over all data-parallel ranks
    procs: int = 1  # trainer procs (dp_shard x tp, see trainer.parallel)
    trainer: TrainerConfig = field(default_factory=_default_trainer)  # optim, parallel, micro_batch_size, ...
    eval_every: int = 0  # greedy held-out evaluation every N steps; 0 = only at the end
    eval_size: int = 500  # held-out arithmetic prompts per evaluation; 0 = no evaluation
    eval_max_tokens: int = 8
    engine_args: dict[str, Any] = field(default_factory=lambda: dict(max_model_len=128))  # vLLM, for evaluation
    save_every: int = 0  # DCP checkpoint every N steps (and always at the end); 0 = only at the end
    resume: bool = False  # continue from the newest checkpoint in trainer.checkpoint_dir
    output_dir: str = "outputs/sft"
    # local, or a Slurm allocation: the trainer on launcher.slurm.trainer_nodes, the evaluation generator on a
    # generator node (docs/slurm.md)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    verbose: bool = False  # true (or --verbose): the procs' output (TorchTitan, vLLM) on the console, not output_dir/logs
    export_dir: str | None = "${output_dir}/hf"  # HF export at the end (empty = none)


# ---- data ------------------------------------------------------------------------------------------


class ArithmeticSource:
    """The arithmetic training stream (held-out questions excluded), example i = problem i of the stream:
    batch `step` is examples [step * B, (step + 1) * B), so a resumed run sees the data it would have seen."""

    def __init__(self, tokenizer, seed: int):
        from forge_rl.data.arithmetic import iter_training_problems

        self.tokenizer, self.stream, self.problems = tokenizer, iter_training_problems(seed), []
        self.cache: dict[str, SFTExample] = {}  # tokenised once per distinct question

    def example(self, i: int) -> SFTExample:
        while len(self.problems) <= i:
            self.problems.append(next(self.stream))
        p = self.problems[i]
        if p.question not in self.cache:
            msgs = [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]
            self.cache[p.question] = tokenize_messages(self.tokenizer, msgs)
        return self.cache[p.question]

    def __len__(self) -> int:
        return sys.maxsize


class ListSource:
    """A finite dataset, reshuffled every epoch with a seed per epoch (deterministic, so resumable)."""

    def __init__(self, examples: list[SFTExample], seed: int):
        self.examples, self.seed, self.perms = examples, seed, {}

    def example(self, i: int) -> SFTExample:
        epoch, pos = divmod(i, len(self.examples))
        if epoch not in self.perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self.perms = {epoch: torch.randperm(len(self.examples), generator=g).tolist()}
        return self.examples[self.perms[epoch][pos]]

    def __len__(self) -> int:
        return len(self.examples)


def make_source(cfg: SFTConfig, tokenizer, max_len: int):
    if cfg.dataset == "arithmetic":
        return ArithmeticSource(tokenizer, cfg.seed)
    return ListSource(load_sft_dataset(cfg.dataset, tokenizer, max_len=max_len), cfg.seed)


def train_batches(source, step: int, batch_size: int, dp: int, pad_id: int) -> list[TrainBatch]:
    """Batch `step` as one TrainBatch per data-parallel rank (rows dealt round-robin). SFT needs no
    advantages or behaviour logprobs: zeros, and policy version 0 on response tokens."""
    episodes = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        ex = source.example(i)
        R = len(ex.response_ids)
        c = Completion(
            prompt_ids=torch.tensor(ex.prompt_ids, dtype=torch.long),
            response_ids=torch.tensor(ex.response_ids, dtype=torch.long),
            logprobs=torch.zeros(R), policy_versions=torch.zeros(R, dtype=torch.long), finish_reason="stop",
        )
        episodes.append(Episode(c, advantage=0.0))
    return [TrainBatch.collate(episodes[r::dp], pad_id=pad_id) for r in range(dp)]


# ---- outputs ---------------------------------------------------------------------------------------


# ---- the run ---------------------------------------------------------------------------------------


def dp_size(cfg: SFTConfig) -> int:
    p = cfg.trainer.parallel
    if cfg.procs % p.tp:
        raise ConfigError(f"procs={cfg.procs} is not a multiple of trainer.parallel.tp={p.tp}")
    dp = cfg.procs // p.tp if p.dp_shard == -1 else p.dp_shard
    if dp * p.tp != cfg.procs:
        raise ConfigError(f"trainer.parallel dp_shard={p.dp_shard} x tp={p.tp} does not fit procs={cfg.procs}")
    if cfg.batch_size % dp:
        raise ConfigError(f"batch_size={cfg.batch_size} is not divisible by the data-parallel degree {dp}")
    return dp


async def main(cfg: SFTConfig) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from forge_rl.controller import provisioned
    from forge_rl.controller.launcher import launched, weight_server
    from forge_rl.controller.provisioner import visible_gpus

    console = Console(soft_wrap=True)  # no hard wraps at 80 columns in a log file
    if cfg.trainer.model not in ("tiny", cfg.model):
        raise ConfigError(f"set the model with `model`, not trainer.model ({cfg.trainer.model!r})")
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise ConfigError(f"steps and batch_size must be >= 1, got steps={cfg.steps}, batch_size={cfg.batch_size}")
    dp = dp_size(cfg)
    model_dir = resolve_model_path(cfg.model)
    trainer_cfg = replace(cfg.trainer, model=model_dir, loss="sft")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    max_len = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    source = make_source(cfg, tokenizer, max_len)
    held_out = None
    if cfg.eval_size:
        from forge_rl.data.arithmetic import held_out_problems

        held_out = held_out_problems(cfg.eval_size)

    # On a GPU host every trainer proc gets its own GPU, and the evaluation generator one more.
    use_gpus = bool(visible_gpus())
    summary: dict[str, Any] = dict(model=cfg.model, dataset=cfg.dataset)
    t_start = time.perf_counter()
    log_dir = None if cfg.verbose else out / "logs"
    async with launched(cfg.launcher, out) as hosts, provisioned(log_dir=log_dir, hosts=hosts):
        if hosts:  # GPUs per node from the launcher, not what the controller's host has
            use_gpus = bool(cfg.launcher.slurm.gpus_per_node)
        weight_source = await weight_server(None) if hosts else None  # the default weight store, as the trainer's
        if log_dir:
            console.print(f"the procs' logs (TorchTitan, vLLM, Monarch) go to {log_dir}/ (--verbose: here)")
        console.print(f"starting the trainer ({cfg.procs} proc(s), dp={dp}) on {model_dir} ...")
        trainer = await Trainer.options(procs=cfg.procs, spmd=True, gpus=use_gpus, host_mesh="trainer").as_actor(
            trainer_cfg)
        start = 0
        if cfg.resume:
            start = (await trainer.load.call()).get(0)
            console.print(f"resumed from {trainer_cfg.checkpoint_dir}/step-{start}")
        summary["start_step"] = start
        log = MetricsLogger(out, resume_step=start if cfg.resume else None)
        generator, exported = None, None
        saved_at: int | None = start if cfg.resume else None

        async def save(step: int) -> str:
            nonlocal saved_at
            path = (await trainer.save.call()).get(0)
            saved_at = step
            return path

        async def evaluate(step: int, final: bool) -> dict:
            """Greedy held-out accuracy of the current weights. The first evaluation starts a generator
            on an HF export of them; later ones push the weights into it (the GRPO weight-sync path)."""
            nonlocal generator, exported
            from forge_rl.actors.generator import Generator
            from forge_rl.eval import greedy_accuracy

            t0 = time.perf_counter()
            if generator is None:
                eval_dir = cfg.export_dir if final and cfg.export_dir else str(out / "eval_model")
                await trainer.export_hf.call(eval_dir)
                exported = eval_dir if final else None
                generator = await Generator.options(replicas=1, gpus=use_gpus, host_mesh="generator").as_service(
                    eval_dir, engine_args=cfg.engine_args, seed=cfg.seed, weight_source=weight_source,
                )
            else:
                await trainer.push_weights.call(step)
                await generator.update_weights.call_all(step)
            result = await greedy_accuracy(generator, tokenizer, held_out, max_tokens=cfg.eval_max_tokens)
            record = dict(**result, eval_s=time.perf_counter() - t0)
            log.log(step, {f"eval/{k}": v for k, v in record.items()})
            return record

        step, interrupted, losses = start, False, []
        t_train = time.perf_counter()
        bar = tqdm(total=cfg.steps, initial=start, desc="sft", unit="step", dynamic_ncols=True)
        try:
            while step < cfg.steps:
                batches = train_batches(source, step, cfg.batch_size, dp, tokenizer.pad_token_id)
                call = asyncio.ensure_future(trainer.train_step.call(batches))
                try:
                    m = (await asyncio.shield(call)).get(0)
                except asyncio.CancelledError:  # Ctrl-C: let the step in flight finish and log it, then stop
                    interrupted = True
                    m = (await call).get(0)
                step = int(m["step"])
                losses.append(m["loss"])
                log.log(step, {"train/loss": m["loss"], "train/grad_norm": m["grad_norm"], "train/lr": m["lr"],
                               "train/tokens_per_s": m["tokens_per_s"], "train/step_s": m["step_s"],
                               "train/elapsed_s": time.perf_counter() - t_train})
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.4f}")
                if interrupted:
                    break
                if cfg.save_every and step % cfg.save_every == 0:
                    await save(step)
                if held_out and cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                    r = await evaluate(step, final=False)
                    bar.write(f"step {step}: held-out greedy accuracy {r['accuracy']:.3f} (n={r['n']})")
        except (asyncio.CancelledError, KeyboardInterrupt):
            interrupted = True  # Ctrl-C: asyncio cancels this task; save what we have and leave
        finally:
            bar.close()
        train_s = time.perf_counter() - t_train
        if interrupted:
            step = (await trainer.version.call()).get(0)  # in case a step was in flight
            console.print(f"[yellow]interrupted at step {step}: saving a checkpoint[/yellow]")
        checkpoint = await save(step) if saved_at != step else f"{trainer_cfg.checkpoint_dir}/step-{step}"
        if not interrupted:
            if held_out:
                r = await evaluate(step, final=True)
                summary.update(eval_accuracy=r["accuracy"], eval_n=r["n"], eval_format_ok=r["format_ok"],
                               eval_s=r["eval_s"])
            if cfg.export_dir and exported != cfg.export_dir:
                await trainer.export_hf.call(cfg.export_dir)

    summary.update(
        steps=step, trained_steps=step - start, interrupted=interrupted,
        first_loss=losses[0] if losses else math.nan, final_loss=losses[-1] if losses else math.nan,
        train_s=train_s, s_per_step=train_s / max(step - start, 1), wall_s=time.perf_counter() - t_start,
        checkpoint=checkpoint, export_dir=(cfg.export_dir or "") if not interrupted else "",
    )
    log.close()
    plot_run(log.path, out / "loss.png", f"SFT {cfg.model} on {Path(cfg.dataset).name}", panels=SFT_PANELS)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    table = Table(title="forge_rl SFT")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(table)
    console.print(f"wrote {out / 'summary.json'}, {out / 'metrics.jsonl'}, {out / 'loss.png'}")
    return summary


CONFIG = SFTConfig  # what `python -m forge_rl.controller.launcher submit --app apps.sft.main` reads

if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cfg = parse_args(SFTConfig, description=__doc__)
    handle_stop_signals()
    try:
        result = asyncio.run(main(cfg))
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    sys.exit(130 if result.get("interrupted") else 0)
