"""GRPO, asynchronous: rollouts and training run concurrently, joined by the replay buffer.

    python -m apps.grpo.main --config configs/grpo/tiny.yaml [key=value ...]

Actors: dataset, generator service (vLLM), reward, replay buffer, trainer (TorchTitan), optional reference.
`rollout_tasks` loops run in this controller: prompt -> generator.generate(n=G) -> reward.score ->
group advantages -> buffer.add (which blocks when the buffer is full). The train loop: buffer.sample(version)
-> trainer.train_step -> trainer.push_weights(version + 1) -> generators update_weights (prefetch, then swap
between engine steps; in async mode the next step starts while generators swap).

`async_mode: false` with `max_policy_age: 0` is the strictly synchronous baseline: generate a batch,
train, sync weights, repeat.
"""

import asyncio
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from tqdm import tqdm

from forge_rl.actors.dataset import ArithmeticDataset
from forge_rl.actors.generator import Generator
from forge_rl.actors.replay_buffer import ReplayBuffer, ReplayBufferConfig
from forge_rl.actors.reward import RewardActor, RewardSpec
from forge_rl.actors.trainer import Trainer, TrainerConfig
from forge_rl.config import parse_args, to_yaml
from forge_rl.controller import provisioned
from forge_rl.controller.provisioner import visible_gpus
from forge_rl.data.arithmetic import chat_prompt, held_out_problems
from forge_rl.eval import greedy_accuracy
from forge_rl.losses.advantages import group_advantages
from forge_rl.models import resolve_model_path
from forge_rl.observability import MetricsLogger, plot_run
from forge_rl.types import Episode, Group, TrainBatch
from forge_rl.weights import WeightStoreConfig


@dataclass
class GeneratorSection:
    replicas: int = 1
    swap_mode: str = "recompute_kv"  # keep_kv | recompute_kv | drain
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM AsyncEngineArgs
    sampling: dict[str, Any] = field(default_factory=lambda: dict(temperature=1.0, max_tokens=8))


@dataclass
class GRPOConfig:
    model: str = "tiny-warm"
    steps: int = 100
    group_size: int = 8  # completions per prompt (G)
    batch_groups: int = 16  # groups per train step
    rollout_tasks: int = 4  # concurrent rollout loops (async mode)
    async_mode: bool = True  # false (+ max_policy_age 0): the synchronous baseline
    max_policy_age: int = 1
    trainer_procs: int = 1
    scale_advantages_by_std: bool = True
    rewards: list[RewardSpec] = field(
        default_factory=lambda: [RewardSpec("exact_match", 1.0), RewardSpec("format", 0.1)]
    )
    generator: GeneratorSection = field(default_factory=GeneratorSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    weight_store: WeightStoreConfig = field(default_factory=WeightStoreConfig)
    eval_every: int = 10  # steps; 0 = only before and after
    eval_size: int = 500  # held-out prompts, greedy
    checkpoint_every: int = 0  # steps; 0 = only at the end
    resume: bool = False
    output_dir: str = "outputs/grpo"
    wandb_project: str | None = None
    seed: int = 0


class Run:
    """The state one GRPO run shares between its rollout tasks and its train loop."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.version = 0  # policy version = trainer steps taken
        self.drops: dict[str, int] = {"reward_error": 0}
        self.rollout_rewards: list[float] = []  # since the last step's log line
        self.rollout_parts: dict[str, list[float]] = {}
        self.generated_tokens = 0
        self.trainer_busy_s = 0.0  # train_step + push_weights, as the controller waits for them
        self.staleness_sum, self.staleness_steps = 0.0, 0
        self.max_staleness = 0  # over every batch trained on: must stay <= max_policy_age
        self.last_updates: list[dict] | None = None  # the newest finished generator weight update
        self.stop = asyncio.Event()


async def rollout_once(run: Run, dataset, generator, reward, buffer, tokenizer) -> int:
    """One group: generate, score, advantages, add to the buffer. Returns generated tokens."""
    cfg = run.cfg
    problem = await dataset.next.call_one()
    prompt = chat_prompt(tokenizer, problem)
    completions = await generator.generate.route(prompt, n=cfg.group_size)
    texts = [c.text for c in completions]
    tokens = sum(len(c.response_ids) for c in completions)
    run.generated_tokens += tokens
    try:
        totals, parts = await reward.score.call_one(problem.question, texts, problem.answer,
                                                    [c.finish_reason for c in completions])
    except Exception as e:  # ActorError around RewardError: drop the group, count it, go on
        run.drops["reward_error"] += len(completions)
        tqdm.write(f"dropped group {problem.id}: {e}".splitlines()[0][:200])
        return tokens
    run.rollout_rewards += totals
    for name, values in parts.items():
        run.rollout_parts.setdefault(name, []).extend(values)
    advantages = group_advantages(totals, scale_by_std=cfg.scale_advantages_by_std)
    episodes = [
        Episode(c, reward=t, rewards={k: v[i] for k, v in parts.items()}, advantage=a, target=problem.answer,
                metadata={"problem": problem.id})
        for i, (c, t, a) in enumerate(zip(completions, totals, advantages))
    ]
    await buffer.add.call_one(Group(problem.id, episodes))
    return tokens


async def rollout_loop(run: Run, *actors) -> None:
    while not run.stop.is_set():
        await rollout_once(run, *actors)


def batch_staleness(batches: list[TrainBatch], version: int) -> tuple[float, int]:
    """Mean and max of (trainer version - version that generated the token) over response tokens."""
    ages = torch.cat([version - b.policy_versions[b.response_mask] for b in batches])
    return float(ages.float().mean()), int(ages.max())


async def main(cfg: GRPOConfig) -> dict:
    from transformers import AutoTokenizer

    console = Console()
    if not cfg.async_mode and cfg.max_policy_age != 0:
        console.print("[yellow]async_mode: false runs a synchronous loop; max_policy_age is set to 0[/yellow]")
        cfg.max_policy_age = 0
    model_dir = resolve_model_path(cfg.model)
    cfg.trainer.model = model_dir
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dp_size = _dp_size(cfg)
    buffer_cfg = ReplayBufferConfig(**{**asdict(cfg.buffer), "max_policy_age": cfg.max_policy_age,
                                       "dp_size": dp_size, "pad_id": tokenizer.pad_token_id or 0, "seed": cfg.seed})
    run = Run(cfg)
    held_out = held_out_problems(cfg.eval_size)
    async with provisioned():
        console.print(f"[bold]GRPO[/bold] {cfg.model}: starting actors (vLLM engine start takes ~30 s on CPU)")
        gpus = bool(visible_gpus())  # one GPU per trainer rank; a generator replica gets one per TP rank
        generator_gpus = int(cfg.generator.engine_args.get("tensor_parallel_size", 1)) if gpus else 0
        trainer, generator, buffer, reward, dataset = await asyncio.gather(
            Trainer.options(procs=cfg.trainer_procs, spmd=True, gpus=gpus).as_actor(cfg.trainer, cfg.weight_store),
            Generator.options(replicas=cfg.generator.replicas, gpus=generator_gpus).as_service(
                model_dir, engine_args=cfg.generator.engine_args, sampling=cfg.generator.sampling, seed=cfg.seed,
                swap_mode=cfg.generator.swap_mode, weight_store=cfg.weight_store,
            ),
            ReplayBuffer.as_actor(buffer_cfg),
            RewardActor.as_actor(cfg.rewards),
            ArithmeticDataset.as_actor(cfg.seed),
        )
        ckpt_dir = Path(cfg.trainer.checkpoint_dir)
        start_step = 0
        if cfg.resume:
            start_step = await _resume(run, trainer, generator, buffer, dataset, ckpt_dir, console)
        log = MetricsLogger(out, cfg.wandb_project, config=asdict(cfg), resume_step=start_step if cfg.resume else None)
        eval_acc = await _evaluate(generator, tokenizer, held_out, cfg)
        first_eval = eval_acc
        log.log(start_step, {"eval/accuracy": eval_acc})
        console.print(f"held-out greedy accuracy at step {start_step}: {eval_acc:.1%} ({len(held_out)} prompts)")
        evals = [(start_step, eval_acc)]
        actors = (dataset, generator, reward, buffer, tokenizer)
        rollouts = []
        if cfg.async_mode:
            rollouts = [asyncio.create_task(rollout_loop(run, *actors)) for _ in range(cfg.rollout_tasks)]
        pending_update: asyncio.Task | None = None
        last_buffer = await buffer.stats.call_one()
        started = time.perf_counter()
        gen_busy_start, eval_busy_s = (await generator.stats.route())["busy_s"], 0.0
        step = start_step
        bar = tqdm(total=cfg.steps, initial=start_step, desc="GRPO steps", unit="step", dynamic_ncols=True)
        try:
            for step in range(start_step + 1, cfg.steps + 1):
                step_start = time.perf_counter()
                gen_tokens_before = run.generated_tokens
                if not cfg.async_mode:  # synchronous: generate this step's groups with the current weights
                    await asyncio.gather(*(rollout_once(run, *actors) for _ in range(cfg.batch_groups)))
                wait_start = time.perf_counter()
                while (batches := await buffer.sample.call_one(run.version, cfg.batch_groups)) is None:
                    if rollouts and all(t.done() for t in rollouts):
                        [t.result() for t in rollouts]  # a rollout loop died: raise its error here
                    if not cfg.async_mode:  # not enough usable groups (zero-advantage drops): top up
                        await rollout_once(run, *actors)
                    else:
                        await asyncio.sleep(0.02)
                sample_wait = time.perf_counter() - wait_start
                staleness, oldest = batch_staleness(batches, run.version)
                run.max_staleness = max(run.max_staleness, oldest)
                busy_start = time.perf_counter()
                metrics = (await trainer.train_step.call(batches)).item(procs=0)
                push = (await trainer.push_weights.call(run.version + 1)).item(procs=0)
                run.trainer_busy_s += time.perf_counter() - busy_start
                run.staleness_sum, run.staleness_steps = run.staleness_sum + staleness, run.staleness_steps + 1
                run.version += 1
                if pending_update is not None:
                    run.last_updates = await pending_update  # one swap at a time, in version order
                pending_update = asyncio.create_task(generator.update_weights.call_all(run.version))
                if not cfg.async_mode:
                    run.last_updates = await pending_update
                if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                    await pending_update
                    eval_start = time.perf_counter()
                    eval_acc = await _evaluate(generator, tokenizer, held_out, cfg)
                    evals.append((step, eval_acc))
                    eval_busy_s += time.perf_counter() - eval_start
                    started += time.perf_counter() - eval_start  # evaluations are not training time
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    await _checkpoint(run, trainer, buffer, dataset, ckpt_dir, step)
                buf = await buffer.stats.call_one()
                gen_stats = await generator.stats.route()
                line = _step_metrics(run, step, metrics, push, run.last_updates, buf, last_buffer, staleness, sample_wait,
                                     time.perf_counter() - step_start, run.generated_tokens - gen_tokens_before,
                                     gen_stats, eval_acc if evals[-1][0] == step else None)
                last_buffer = buf
                log.log(step, line)
                bar.update(1)
                bar.set_postfix(reward=f"{line['reward/mean']:.2f}", acc=f"{eval_acc:.0%}")
                tqdm.write(_console_line(step, line))
        except (KeyboardInterrupt, asyncio.CancelledError):
            console.print(f"[yellow]interrupted at step {step}: saving a final checkpoint[/yellow]")
            run.stop.set()
            for t in rollouts:
                t.cancel()
            await _checkpoint(run, trainer, buffer, dataset, ckpt_dir, run.version)
            raise
        finally:
            bar.close()
        run.stop.set()
        for t in rollouts:
            t.cancel()
        await asyncio.gather(*rollouts, return_exceptions=True)
        if pending_update is not None:
            await pending_update
        wall = time.perf_counter() - started  # the training phase: start-up and evaluations excluded
        gen_busy_s = (await generator.stats.route())["busy_s"] - gen_busy_start - eval_busy_s
        if step > start_step:
            eval_acc = await _evaluate(generator, tokenizer, held_out, cfg)
            evals.append((step, eval_acc))
            log.log(step, {"eval/accuracy": eval_acc})
        await _checkpoint(run, trainer, buffer, dataset, ckpt_dir, run.version)
        final_buffer = await buffer.evict.call_one()
        gen_version = await generator.version.route()
        gen_stats = await generator.stats.route()
        log.close()
    last3 = [acc for _, acc in evals[-3:]]
    summary = dict(
        steps=cfg.steps, start_step=start_step, wall_s=wall, steps_per_min=(cfg.steps - start_step) / wall * 60,
        eval_first=first_eval, eval_last3_mean=statistics.mean(last3), evals=evals,
        generator_version=gen_version, trainer_version=run.version, max_staleness=run.max_staleness,
        mean_staleness=run.staleness_sum / max(run.staleness_steps, 1),
        trainer_idle_fraction=1 - run.trainer_busy_s / wall, generator_idle_fraction=1 - gen_busy_s / wall,
        generator_stats=gen_stats,
        buffer=final_buffer, drops={**final_buffer["dropped"], **run.drops},
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    png = plot_run(out / "metrics.jsonl", out / "curves.png", title=f"GRPO {cfg.model}")
    console.print(
        f"[bold green]done[/bold green]: {cfg.steps - start_step} steps in {wall:.0f} s; held-out accuracy "
        f"{first_eval:.1%} -> {summary['eval_last3_mean']:.1%} (mean of the last {len(last3)} evaluations); "
        f"curves: {png}"
    )
    return summary


def _dp_size(cfg: GRPOConfig) -> int:
    p = cfg.trainer.parallel
    dp = cfg.trainer_procs // p.tp if p.dp_shard == -1 else p.dp_shard
    if dp < 1 or cfg.batch_groups % dp:
        raise ValueError(f"batch_groups={cfg.batch_groups} must be a multiple of the data-parallel size {dp}")
    return dp


async def _evaluate(generator, tokenizer, problems, cfg: GRPOConfig) -> float:
    result = await greedy_accuracy(generator, tokenizer, problems, max_tokens=cfg.generator.sampling.get("max_tokens", 8))
    return result["accuracy"]


async def _checkpoint(run: Run, trainer, buffer, dataset, ckpt_dir: Path, step: int) -> None:
    """Trainer DCP checkpoint plus the controller's state (buffer, data position, counters)."""
    path = Path((await trainer.save.call(step)).item(procs=0))
    state = dict(version=run.version, drops=run.drops, buffer=await buffer.state_dict.call_one(),
                 dataset=await dataset.state_dict.call_one())
    torch.save(state, path / "app_state.pt")


async def _resume(run: Run, trainer, generator, buffer, dataset, ckpt_dir: Path, console) -> int:
    candidates = sorted((p for p in ckpt_dir.glob("step-*") if (p / "app_state.pt").is_file()),
                        key=lambda p: int(p.name.split("-")[1]))
    if not candidates:
        raise FileNotFoundError(f"resume=true but no checkpoint with app_state.pt under {ckpt_dir}")
    path = candidates[-1]
    step = (await trainer.load.call(str(path))).item(procs=0)
    state = torch.load(path / "app_state.pt", weights_only=False)
    run.version, run.drops = state["version"], state["drops"]
    await buffer.load_state_dict.call_one(state["buffer"])
    await dataset.load_state_dict.call_one(state["dataset"])
    if run.version > 0:  # the generators start from the model dir: give them the resumed weights
        await trainer.push_weights.call(run.version)
        await generator.update_weights.call_all(run.version)
    console.print(f"resumed from {path} at step {step} (policy version {run.version})")
    return step


def _step_metrics(run, step, metrics, push, updates, buf, last_buf, staleness, sample_wait, step_s, gen_tokens,
                  gen_stats, eval_acc) -> dict[str, float]:
    rewards, parts = run.rollout_rewards, run.rollout_parts
    line = {
        "reward/mean": statistics.mean(rewards) if rewards else math.nan,
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        **{f"reward/{k}": statistics.mean(v) for k, v in parts.items() if v},
        "train/accuracy": statistics.mean(parts["exact_match"]) if parts.get("exact_match") else math.nan,
        "trainer/loss": metrics["loss"], "trainer/grad_norm": metrics["grad_norm"],
        "trainer/clip_fraction": metrics["clip_fraction"], "trainer/approx_kl": metrics["approx_kl"],
        "trainer/entropy": metrics["entropy"], "trainer/tokens_per_s": metrics["tokens_per_s"],
        "trainer/step_s": metrics["step_s"],
        "batch/staleness": staleness,
        "batch/staleness_max_run": run.max_staleness,
        "sync/push_s": push["push_s"],
        "generator/tokens_per_s": gen_tokens / step_s if step_s else 0.0,
        "generator/policy_version": gen_stats["policy_version"],
        "buffer/groups": buf["groups"],
        "buffer/sample_wait_s": sample_wait,
        "buffer/add_blocked_s": buf["add_blocked_s"] - last_buf["add_blocked_s"],
        "step_s": step_s,
    }
    if updates:
        line["sync/prefetch_s"] = max(u["prefetch_s"] for u in updates)
        line["sync/pause_s"] = max(u["pause_s"] for u in updates)
    for reason, count in {**buf["dropped"], **run.drops}.items():
        line[f"drops/{reason}"] = count
    if eval_acc is not None:
        line["eval/accuracy"] = eval_acc
    run.rollout_rewards, run.rollout_parts = [], {}
    return line


def _console_line(step: int, m: dict[str, float]) -> str:
    drops = ",".join(f"{k.split('/')[1]}={int(v)}" for k, v in m.items() if k.startswith("drops/") and v)
    parts = [
        f"step {step:4d}", f"reward {m['reward/mean']:.2f}±{m['reward/std']:.2f}",
        f"acc {m['train/accuracy']:.0%}", f"stale {m['batch/staleness']:.2f}",
        f"gen {m['generator/tokens_per_s']:.0f} tok/s", f"train {m['trainer/tokens_per_s']:.0f} tok/s",
        f"push {m['sync/push_s']:.2f}s", f"pause {m.get('sync/pause_s', 0):.2f}s",
        f"buffer {int(m['buffer/groups'])}", f"wait sample {m['buffer/sample_wait_s']:.2f}s",
        f"add {m['buffer/add_blocked_s']:.2f}s",
    ]
    if "eval/accuracy" in m:
        parts.append(f"EVAL {m['eval/accuracy']:.1%}")
    if drops:
        parts.append(f"drops {drops}")
    return " | ".join(parts)


if __name__ == "__main__":
    config = parse_args(GRPOConfig, description=__doc__.splitlines()[0])
    try:
        asyncio.run(main(config))
    except KeyboardInterrupt:
        raise SystemExit(130)
