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
import contextlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from tqdm import tqdm

from forge_rl.actors.dataset import PromptDataset
from forge_rl.actors.generator import Generator
from forge_rl.actors.reference import Reference
from forge_rl.actors.replay_buffer import ReplayBuffer, ReplayBufferConfig
from forge_rl.actors.reward import RewardActor, RewardSpec, check_reward_columns
from forge_rl.actors.trainer import Trainer, TrainerConfig
from forge_rl.checkpoint import complete_checkpoints, resume_from_checkpoint, resume_requested, save_checkpoint
from forge_rl.config import ConfigError, parse_args, to_yaml
from forge_rl.controller import provisioned
from forge_rl.controller.launcher import LauncherConfig, launched, weight_server
from forge_rl.controller.signals import handle_stop_signals
from forge_rl.controller.provisioner import visible_gpus
from forge_rl.data.task import TaskConfig, TaskRows
from forge_rl.envs import EnvConfig, env_factory
from forge_rl.eval import evaluate_task
from forge_rl.models import resolve_model_path
from forge_rl.multiturn import TurnRenderer, evaluate_env, rollout_env_from_dataset
from forge_rl.observability import MetricsLogger, plot_run
from forge_rl.resources import Placement, ResourcesConfig, plan_placement
from forge_rl.rewards.overlong import OverlongConfig
from forge_rl.rollout import rollout_from_dataset, rollout_loop
from forge_rl.sampling import behaviour_temperature
from forge_rl.train_loop import (
    RoleDied, Run, SupervisionError, batch_staleness, raise_if_failed, role_died, update_generators, wait_for_batch,
)
from forge_rl.weights import WeightStoreConfig


@dataclass
class GeneratorSection:
    replicas: int = 1
    swap_mode: str = "recompute_kv"  # keep_kv | recompute_kv | drain
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM AsyncEngineArgs
    log_level: str = "WARNING"  # vLLM's console output; INFO shows its per-update lines
    # vLLM SamplingParams: the behaviour policy. The trainer reads its temperature from here; options it
    # cannot reproduce (top_p, top_k, min_p, penalties) are refused at start.
    sampling: dict[str, Any] = field(default_factory=lambda: dict(temperature=1.0, max_tokens=8))


@dataclass
class BufferSection:
    """The replay buffer's own settings; max_policy_age, the data-parallel size and padding come from
    the run (top-level `max_policy_age`, trainer.parallel, the tokenizer)."""

    capacity: int = 64  # groups
    order: str = "oldest"  # "oldest" | "random"
    max_resample: int = 1  # times a group may be trained on
    min_fresh_groups: int = 1
    drop_zero_advantage: bool = True


@dataclass
class GRPOConfig:
    model: str = "tiny-warm"
    steps: int = 100
    group_size: int = 8  # completions per prompt (G)
    batch_groups: int = 16  # groups per train step
    rollout_tasks: int = 4  # concurrent rollouts at most (admission may allow fewer)
    async_mode: bool = True  # false (+ max_policy_age 0): the synchronous baseline
    max_policy_age: int = 1  # a token made by version u is trained on at version v only if v - u <= this
    trainer_procs: int = 1
    scale_advantages_by_std: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    task: TaskConfig = field(default_factory=TaskConfig)  # prompts, columns, held-out split (forge_rl/data/task.py)
    rewards: list[RewardSpec] = field(
        default_factory=lambda: [RewardSpec("exact_match", 1.0), RewardSpec("format", 0.1)]
    )
    reward_timeout_s: float | None = 60.0  # per reward function call; a slower group is dropped and counted
    # Multi-turn: an environment answers each model turn (feedback, tool results) until done; it rewards the
    # trajectory, and its tokens are masked out of the loss (forge_rl/envs, forge_rl/multiturn.py)
    env: EnvConfig = field(default_factory=EnvConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # DAPO: length penalty, truncation filter
    generator: GeneratorSection = field(default_factory=GeneratorSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer: BufferSection = field(default_factory=BufferSection)
    weight_store: WeightStoreConfig = field(default_factory=WeightStoreConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)  # placement, cores, threads
    launcher: LauncherConfig = field(default_factory=LauncherConfig)  # local, or a Slurm allocation (docs/slurm.md)
    eval_every: int = 10  # steps; 0 = only before and after
    eval_size: int = 500  # held-out prompts (the first of the task's held-out set), greedy
    checkpoint_every: int = 0  # steps; 0 = only at the end
    checkpoint_keep_last: int = 3  # complete checkpoints kept (older ones removed); 0 = all
    export_dir: str | None = "${output_dir}/hf"  # the final policy as an HF model directory (vLLM, transformers); null = none
    no_batch_timeout_s: float = 300.0  # stop, saying why, when no batch could be sampled for this long
    resume: bool | str = False  # true: continue from the newest checkpoint; auto: if there is one, else start
    output_dir: str = "outputs/grpo"
    # false: the role processes' output (vLLM, TorchTitan, Monarch) goes to output_dir/logs/<role>.log and the
    # console shows the run's progress; true (or --verbose): everything on the console
    verbose: bool = False
    wandb_project: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "batch_groups", "rollout_tasks", "trainer_procs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_policy_age < 0:
            raise ValueError(f"max_policy_age must be >= 0, got {self.max_policy_age}")
        if self.checkpoint_keep_last < 0:
            raise ValueError(f"checkpoint_keep_last must be >= 0 (0 keeps all), got {self.checkpoint_keep_last}")
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"resume={self.resume!r}: use true, false or auto")
        if self.no_batch_timeout_s <= 0:
            raise ValueError(f"no_batch_timeout_s must be > 0, got {self.no_batch_timeout_s}")


def check_config(cfg: GRPOConfig) -> None:
    """Settings that only make sense together; errors name the keys."""
    temperature = behaviour_temperature(cfg.generator.sampling)
    if cfg.trainer.temperature is not None and cfg.trainer.temperature != temperature:
        raise ConfigError(
            f"trainer.temperature={cfg.trainer.temperature} differs from generator.sampling.temperature="
            f"{temperature}: the trainer must reproduce the sampling policy; set only generator.sampling.temperature"
        )
    cfg.trainer.temperature = temperature
    if cfg.trainer.publish_dtype is None and cfg.generator.engine_args.get("dtype") in ("float32", "bfloat16"):
        cfg.trainer.publish_dtype = cfg.generator.engine_args["dtype"]  # push weights as the engine holds them
    logprobs_mode = cfg.generator.engine_args.get("logprobs_mode", "processed_logprobs")
    if logprobs_mode != "processed_logprobs":
        raise ConfigError(f"generator.engine_args.logprobs_mode={logprobs_mode!r}: behaviour logprobs must be of the "
                          "sampled distribution (after temperature); use 'processed_logprobs'")
    if cfg.buffer.capacity < cfg.batch_groups:
        raise ConfigError(f"buffer.capacity={cfg.buffer.capacity} is smaller than batch_groups={cfg.batch_groups}")
    overlong = cfg.overlong.filter or cfg.overlong.penalty_cache_len
    if overlong and cfg.env.name is not None:
        raise ConfigError("overlong.* applies to single-turn rollouts; with env.name set, limit trajectories with "
                          "env.max_total_tokens")
    if cfg.overlong.penalty_cache_len >= cfg.generator.sampling.get("max_tokens", 16):
        raise ConfigError(f"overlong.penalty_cache_len={cfg.overlong.penalty_cache_len} must be smaller than "
                          f"generator.sampling.max_tokens={cfg.generator.sampling.get('max_tokens', 16)}")
    if cfg.env.name is not None:
        try:
            env_cls = env_factory(cfg.env)  # an unknown name or arguments fail here, naming env.name / env.args
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # what the environment needs the chat template to show the model (e.g. its tools)
        cfg.chat_template_kwargs = {**env_cls.template_kwargs, **cfg.chat_template_kwargs}
    if cfg.launcher.kind == "slurm":
        check_slurm_sizes(cfg)
    names = [r.name for r in cfg.rewards]
    if cfg.task.eval_reward is not None and cfg.task.eval_reward not in names:
        raise ConfigError(f"task.eval_reward={cfg.task.eval_reward!r} is not one of the rewards {names}")


def check_slurm_sizes(cfg: GRPOConfig) -> None:
    """Ranks and replicas must fit the nodes asked for: an allocation that cannot hold them fails after the queue."""
    s = cfg.launcher.slurm
    if cfg.trainer_procs % s.trainer_nodes:
        raise ConfigError(f"trainer_procs={cfg.trainer_procs} must spread evenly over launcher.slurm.trainer_nodes="
                          f"{s.trainer_nodes}")
    if s.gpus_per_node:
        per_node = cfg.trainer_procs // s.trainer_nodes
        tp = int(cfg.generator.engine_args.get("tensor_parallel_size", 1))
        replicas_per_node = math.ceil(cfg.generator.replicas / s.generator_nodes)
        if per_node > s.gpus_per_node:
            raise ConfigError(f"trainer_procs={cfg.trainer_procs} over launcher.slurm.trainer_nodes={s.trainer_nodes} "
                              f"is {per_node} ranks per node; launcher.slurm.gpus_per_node={s.gpus_per_node}")
        if replicas_per_node * tp > s.gpus_per_node:
            raise ConfigError(f"generator.replicas={cfg.generator.replicas} x tensor_parallel_size={tp} on "
                              f"launcher.slurm.generator_nodes={s.generator_nodes} needs {replicas_per_node * tp} GPUs "
                              f"per node; launcher.slurm.gpus_per_node={s.gpus_per_node}")


def check_task(cfg: GRPOConfig) -> None:
    """Read the task's data and match it to the rewards before any actor starts: a bad row or a missing column
    fails in seconds, naming the file, the row and the column."""
    try:
        rows = TaskRows(cfg.task, cfg.seed)
        if cfg.env.name is None:  # an environment scores trajectories itself
            check_reward_columns(cfg.rewards, rows.columns())
    except ValueError as e:  # DataError included
        raise ConfigError(str(e)) from None


async def main(cfg: GRPOConfig, reference_model: str | None = None) -> dict:
    """`reference_model`: whose logprobs fill TrainBatch.ref_logprobs every step, a teacher for on-policy
    distillation (apps/distill); by default the starting policy, when the KL penalty (trainer.grpo.kl_coef) needs it."""
    from transformers import AutoTokenizer

    console = Console(soft_wrap=True)  # no hard wraps at 80 columns in a log file
    if not cfg.async_mode and cfg.max_policy_age != 0:
        console.print("[yellow]async_mode: false runs a synchronous loop; max_policy_age is set to 0[/yellow]")
        cfg.max_policy_age = 0
    check_config(cfg)
    model_dir = resolve_model_path(cfg.model)
    cfg.trainer.model = model_dir
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check_task(cfg)
    dp_size = _dp_size(cfg)
    buffer_cfg = ReplayBufferConfig(**asdict(cfg.buffer), max_policy_age=cfg.max_policy_age, dp_size=dp_size,
                                    pad_id=tokenizer.pad_token_id or 0, seed=cfg.seed)
    run = Run(cfg)
    log_dir = None if cfg.verbose else out / "logs"
    if cfg.launcher.kind == "slurm":
        console.print(f"[bold]GRPO[/bold] on Slurm: waiting for {cfg.launcher.slurm.trainer_nodes} trainer + "
                      f"{cfg.launcher.slurm.generator_nodes} generator nodes")
    async with launched(cfg.launcher, out) as hosts, provisioned(log_dir=log_dir, hosts=hosts):
        console.print(f"[bold]GRPO[/bold] {cfg.model}: starting actors (vLLM engine start takes ~30 s on CPU)")
        if log_dir:
            console.print(f"the role processes' logs (vLLM, TorchTitan, Monarch) go to {log_dir}/ (--verbose: here)")
        if hosts:  # every role on hosts of its own: GPUs per node from the launcher, cores not pinned
            node_gpus = cfg.launcher.slurm.gpus_per_node or 0
            gpus = [str(i) for i in range(node_gpus)]
            placement = host_placement(cfg.launcher, node_gpus)
        else:
            gpus = visible_gpus()  # one GPU per trainer rank; a generator replica gets one per TP rank
        generator_gpus = int(cfg.generator.engine_args.get("tensor_parallel_size", 1)) if gpus else 0
        if not hosts:
            placement = plan_placement(cfg.resources, cfg.trainer_procs, cfg.generator.replicas, generator_gpus, gpus)
        console.print(placement.describe())
        # Generators on other hosts than the trainer copy each version from the trainer's host (Monarch RDMA).
        weight_source = await weight_server(cfg.weight_store) if hosts else None
        engine_args = dict(cfg.generator.engine_args)
        if placement.colocated and placement.device == "cuda":
            engine_args.setdefault("enable_sleep_mode", True)  # the engine sleeps while the trainer steps
        shared = placement.colocated and placement.device == "cuda"
        trainer, generator, buffer, reward, dataset = await asyncio.gather(
            Trainer.options(procs=cfg.trainer_procs, spmd=True, gpus=bool(gpus), share_gpus=shared, host_mesh="trainer",
                            cpus=_tuples(placement.trainer_cpus), threads=placement.trainer_threads,
                            ).as_actor(cfg.trainer, cfg.weight_store),
            Generator.options(replicas=cfg.generator.replicas, gpus=generator_gpus, share_gpus=shared, host_mesh="generator",
                              cpus=_tuples(placement.generator_cpus)).as_service(
                model_dir, engine_args=engine_args, sampling=cfg.generator.sampling, seed=cfg.seed,
                swap_mode=cfg.generator.swap_mode, weight_store=cfg.weight_store, weight_source=weight_source,
                log_level=cfg.generator.log_level, lora=cfg.trainer.lora,
            ),
            ReplayBuffer.as_actor(buffer_cfg),
            RewardActor.as_actor(cfg.rewards, cfg.reward_timeout_s),
            PromptDataset.as_actor(cfg.task, model_dir, cfg.seed, _max_prompt_tokens(cfg, model_dir),
                                   cfg.chat_template_kwargs),
        )
        held_out = await dataset.held_out.call_one(cfg.eval_size)
        if not held_out:
            console.print("[yellow]the task has no held-out set (task.held_out, task.held_out_fraction): "
                          "no evaluations[/yellow]")
        reference = None
        if cfg.trainer.grpo.kl_coef > 0 or reference_model:  # a frozen policy, on the trainer's cores
            reference = await Reference.options(
                procs=cfg.trainer_procs, spmd=True, gpus=bool(gpus), share_gpus=True, host_mesh="trainer",
                cpus=_tuples(placement.trainer_cpus), threads=placement.trainer_threads,
            ).as_actor(replace(cfg.trainer, model=reference_model) if reference_model else cfg.trainer)
        ckpt_dir = Path(cfg.trainer.checkpoint_dir)
        start_step = 0
        resumed = resume_requested(cfg.resume, ckpt_dir)
        if resumed:
            start_step, path = await resume_from_checkpoint(run, trainer, generator, buffer, dataset, ckpt_dir)
            console.print(f"resumed from {path} at step {start_step} (policy version {run.version})")
        log = MetricsLogger(out, cfg.wandb_project, config=asdict(cfg), resume_step=start_step if resumed else None)
        scores = await _evaluate(generator, reward, held_out, cfg)
        eval_acc = first_eval = scores["eval/accuracy"]
        log.log(start_step, scores)
        console.print(f"held-out greedy accuracy at step {start_step}: {eval_acc:.1%} ({len(held_out)} prompts, "
                      f"{_eval_reward(cfg)})")
        evals = [(start_step, 0.0, eval_acc)]  # (step, training seconds so far, accuracy)
        actors = dict(dataset=dataset, generator=generator, buffer=buffer, group_size=cfg.group_size,
                      stats=run.rollouts, scale_advantages_by_std=cfg.scale_advantages_by_std)
        if cfg.env.name is None:
            def rollout_once():
                return rollout_from_dataset(reward=reward, overlong=cfg.overlong,
                                            max_tokens=cfg.generator.sampling.get("max_tokens", 16), **actors)
        else:
            turns = dict(make_env=env_factory(cfg.env), renderer=TurnRenderer(tokenizer, **cfg.chat_template_kwargs),
                         env_cfg=cfg.env, max_tokens=cfg.generator.sampling.get("max_tokens", 16))

            def rollout_once():
                return rollout_env_from_dataset(**turns, **actors)
        # Synchronous: the whole batch is generated at once (and zero-advantage top-ups run concurrently).
        tasks = cfg.rollout_tasks if cfg.async_mode else max(cfg.rollout_tasks, cfg.batch_groups)
        rollouts = [asyncio.create_task(rollout_loop(run.admission, run.stop, rollout_once)) for _ in range(tasks)]
        pending_update: asyncio.Task | None = None
        step_task: asyncio.Future | None = None
        last_buffer = await buffer.stats.call_one()
        started = time.perf_counter()
        gen_busy_start, eval_busy_s = (await generator.stats.route())["busy_s"], 0.0
        step = start_step
        # no bar without a terminal (nohup, CI, a batch step): the step lines say it all
        bar = tqdm(total=cfg.steps, initial=start_step, desc="GRPO steps", unit="step", dynamic_ncols=True,
                   disable=None)
        try:
            for step in range(start_step + 1, cfg.steps + 1):
                step_start = time.perf_counter()
                gen_tokens_before = run.rollouts.generated_tokens
                batches, sample_wait = await wait_for_batch(run, buffer, rollouts)
                # the next batch is sampled at version + 1: admit only what that batch can still use
                stored = run.admission.stored
                await run.admission.sampled((await buffer.stats.call_one())["groups"], run.version + 1, stored)
                staleness, oldest = batch_staleness(batches, run.version)
                run.max_staleness = max(run.max_staleness, oldest)
                if placement.colocated:  # the trainer gets the device: the generators step aside
                    if pending_update is not None:
                        run.last_updates, pending_update = await pending_update, None
                    await generator.hold.call_all()
                busy_start = time.perf_counter()
                step_task = asyncio.ensure_future(train_and_publish(run, trainer, reference, batches))
                metrics, push = await asyncio.shield(step_task)  # an interrupt lets the step finish (see below)
                run.trainer_busy_s += time.perf_counter() - busy_start
                if placement.colocated:
                    await generator.release.call_all()
                run.staleness_sum, run.staleness_steps = run.staleness_sum + staleness, run.staleness_steps + 1
                if pending_update is not None:
                    run.last_updates = await pending_update  # one swap at a time, in version order
                pending_update = asyncio.create_task(update_generators(run, generator, run.version))
                if not cfg.async_mode:
                    run.last_updates = await pending_update
                if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                    await pending_update
                    eval_start = time.perf_counter()
                    await run.admission.pause()  # evaluations are untimed: no rollouts run meanwhile
                    scores = await _evaluate(generator, reward, held_out, cfg)
                    eval_acc = scores["eval/accuracy"]
                    await run.admission.pause(False)
                    evals.append((step, eval_start - started, eval_acc))
                    eval_busy_s += time.perf_counter() - eval_start
                    started += time.perf_counter() - eval_start  # evaluations are not training time
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    # every group started lands in the buffer first: the checkpoint holds it and the data position
                    if not await run.admission.quiesce(timeout_s=60):
                        console.print("[yellow]checkpoint: rollouts still in flight after 60 s; their prompts are "
                                      "skipped on resume[/yellow]")
                    await save_checkpoint(run, trainer, buffer, dataset, step, ckpt_dir, cfg.checkpoint_keep_last)
                    await run.admission.pause(False)
                raise_if_failed(rollouts)
                buf = await buffer.stats.call_one()
                gen_stats = await generator.stats.route()
                data_stats = await dataset.stats.call_one()
                line = _step_metrics(run, step, metrics, push, run.last_updates, buf, last_buffer, staleness, sample_wait,
                                     time.perf_counter() - step_start, run.rollouts.generated_tokens - gen_tokens_before,
                                     gen_stats, data_stats, scores if evals[-1][0] == step else None)
                last_buffer = buf
                log.log(step, line)
                bar.update(1)
                bar.set_postfix(reward=f"{line['reward/mean']:.2f}", acc=f"{eval_acc:.0%}")
                tqdm.write(_console_line(step, line))
        except SupervisionError as e:  # a role's process died: name it and the checkpoint to resume from
            raise role_died(e, ckpt_dir, log_dir) from e
        except (KeyboardInterrupt, asyncio.CancelledError):
            console.print(f"[yellow]interrupted at step {step}: saving a final checkpoint[/yellow]")
            if step_task is not None and not step_task.done():  # the trainer's step and the run's version agree
                with contextlib.suppress(Exception):
                    await step_task
            # Rollouts in flight get a moment to land in the buffer, so their prompts are not skipped on resume.
            await run.admission.quiesce(timeout_s=10)
            run.stop.set()
            for t in rollouts:
                t.cancel()
            await save_checkpoint(run, trainer, buffer, dataset, run.version, ckpt_dir, cfg.checkpoint_keep_last)
            raise
        finally:
            bar.close()
            run.stop.set()
            for t in rollouts:
                t.cancel()
            await asyncio.gather(*rollouts, return_exceptions=True)
        if pending_update is not None:
            run.last_updates = await pending_update
        wall = time.perf_counter() - started  # the training phase: start-up and evaluations excluded
        # A replica respawning now (it died late in the run) joins the final evaluation with the final weights.
        if not await generator.wait_healthy(timeout_s=300):
            console.print("[yellow]a generator replica is still down after 300 s; evaluating without it[/yellow]")
        await update_generators(run, generator, run.version)
        gen_busy_s = (await generator.stats.route())["busy_s"] - gen_busy_start - eval_busy_s
        if step > start_step:
            scores = await _evaluate(generator, reward, held_out, cfg)
            eval_acc = scores["eval/accuracy"]
            evals.append((step, wall, eval_acc))
            log.log(step, scores)
        await save_checkpoint(run, trainer, buffer, dataset, run.version, ckpt_dir, cfg.checkpoint_keep_last)
        if cfg.export_dir:
            await trainer.export_hf.call(cfg.export_dir)  # with LoRA: merged into the base
            if cfg.trainer.lora.enabled:  # and the adapter alone, as PEFT saves one
                await trainer.export_adapter.call(str(Path(cfg.export_dir) / "adapter"))
        final_buffer = await buffer.evict.call_one()
        data_stats = await dataset.stats.call_one()
        gen_version = await generator.version.route()
        gen_versions = await generator.version.call_all()  # every replica, respawned ones included
        gen_stats = await generator.stats.route()
        log.close()
    last3 = [acc for *_, acc in evals[-3:]]
    generated = final_buffer["added"] + run.drops["reward_error"] + run.drops["reward_timeout"]
    summary = dict(
        steps=cfg.steps, start_step=start_step, wall_s=wall, steps_per_min=(cfg.steps - start_step) / wall * 60,
        eval_first=first_eval, eval_last3_mean=statistics.mean(last3), evals=evals,
        time_to_60=next((t for _, t, acc in evals if acc >= 0.6), None),
        generator_version=gen_version, generator_versions=gen_versions, trainer_version=run.version,
        generator_respawns=generator.service_stats.respawns, max_staleness=run.max_staleness,
        mean_staleness=run.staleness_sum / max(run.staleness_steps, 1),
        trainer_idle_fraction=1 - run.trainer_busy_s / wall, generator_idle_fraction=1 - gen_busy_s / wall,
        generator_stats=gen_stats, admission_wait_s=run.admission.wait_s, placement=placement.describe(),
        stale_fraction=final_buffer["dropped"]["stale"] / max(generated, 1),
        buffer=final_buffer, drops=_drops(final_buffer, run, data_stats), data=data_stats,
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    png = plot_run(out / "metrics.jsonl", out / "curves.png", title=f"GRPO {cfg.model}")
    console.print(_summary_block(summary, cfg, out, png, complete_checkpoints(ckpt_dir)[-1], log_dir))
    return summary


def _summary_block(summary: dict, cfg: GRPOConfig, out: Path, png: Path, checkpoint: Path,
                   log_dir: Path | None) -> str:
    """What a person wants to see at the end of a run, and where everything is."""
    buf, done = summary["buffer"], summary["steps"] - summary["start_step"]
    drops = ", ".join(f"{reason} {n}" for reason, n in sorted(summary["drops"].items(), key=lambda kv: -kv[1]) if n)
    last = len(summary["evals"][-3:])
    rows = [
        ("steps", f"{done} (to step {summary['trainer_version']}) in {summary['wall_s']:.0f} s of training, "
                  f"{summary['steps_per_min']:.1f} steps/min (start-up and evaluations excluded)"),
        ("held-out", f"{summary['eval_first']:.1%} -> {summary['eval_last3_mean']:.1%} "
                     f"({_eval_reward(cfg)}, mean of the last {last} evaluations)"),
        ("episodes", f"{buf['added']} reached the buffer, {buf['trained']} trained; "
                     f"stale {summary['stale_fraction']:.1%} of generated"),
        ("drops", drops or "none"),
        ("generators", f"policy versions {summary['generator_versions']}, {summary['generator_respawns']} respawned"),
        ("curves", str(png)),
        ("metrics", f"{out / 'metrics.jsonl'}, {out / 'tensorboard'}, {out / 'summary.json'}"),
        ("checkpoint", f"{checkpoint} (resume=true continues from it)"),
        *([("model", f"{cfg.export_dir} (HF format: vLLM, transformers, model=...)")] if cfg.export_dir else []),
        *([("adapter", f"{cfg.export_dir}/adapter (PEFT LoRA: peft, vLLM --lora-modules)")]
          if cfg.export_dir and cfg.trainer.lora.enabled else []),
    ]
    if log_dir:
        rows.append(("logs", f"{log_dir}/ (vLLM, TorchTitan, Monarch)"))
    width = max(len(k) for k, _ in rows)
    return "[bold green]done[/bold green]\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


async def train_and_publish(run: Run, trainer, reference, batches) -> tuple[dict, dict]:
    """One optimizer step, its weights published, the run's policy version advanced. It runs to the end even when
    the app is interrupted (SIGTERM, Ctrl-C, a time limit), so a final checkpoint never holds a trainer one step
    ahead of the run's version, buffer and data position."""
    if reference is not None:  # the frozen reference policy, or a distillation teacher
        batches = (await reference.fill_ref_logprobs.call(batches)).get(0)
    metrics = (await trainer.train_step.call(batches)).get(0)
    push = (await trainer.push_weights.call(run.version + 1)).get(0)
    run.version += 1
    return metrics, push


def host_placement(launcher: LauncherConfig, node_gpus: int) -> Placement:
    """Roles on hosts of their own (a Slurm allocation): nothing to share, nothing to pin."""
    s = launcher.slurm
    where = f"{node_gpus} GPUs per node" if node_gpus else "CPU"
    return Placement("disaggregated", "cuda" if node_gpus else "cpu",
                     note=f"trainer on {s.trainer_nodes} node(s), generators on {s.generator_nodes} node(s), {where}")


def _tuples(lists: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(x) for x in lists)


def _dp_size(cfg: GRPOConfig) -> int:
    p = cfg.trainer.parallel
    dp = cfg.trainer_procs // p.tp if p.dp_shard == -1 else p.dp_shard
    if dp < 1 or cfg.batch_groups % dp:
        raise ValueError(f"batch_groups={cfg.batch_groups} must be a multiple of the data-parallel size {dp}")
    return dp


def _drops(buf: dict, run: Run, data_stats: dict) -> dict[str, int]:
    """Every drop reason: the buffer's (episodes), the rollouts' (episodes; prompt_too_long in prompts) and the
    prompts the dataset skipped as too long for the engine."""
    drops = {**buf["dropped"], **run.drops}
    drops["prompt_too_long"] += data_stats["too_long"]
    return drops


def _eval_reward(cfg: GRPOConfig) -> str:
    if cfg.env.name is not None:
        return f"solved within {cfg.env.max_turns} turns ({cfg.env.name})"
    return cfg.task.eval_reward or cfg.rewards[0].name


async def _evaluate(generator, reward, examples, cfg: GRPOConfig) -> dict[str, float]:
    """`eval/accuracy`: the mean of the eval reward over the held-out examples, greedy (NaN when the task has
    none); with an environment, the fraction solved within env.max_turns, and `eval/first_turn`."""
    if not examples:
        return {"eval/accuracy": math.nan}
    max_tokens = cfg.generator.sampling.get("max_tokens", 8)
    if cfg.env.name is not None:  # solved within env.max_turns, greedy
        from transformers import AutoTokenizer

        renderer = TurnRenderer(AutoTokenizer.from_pretrained(cfg.trainer.model), **cfg.chat_template_kwargs)
        result = await evaluate_env(generator, examples, env_factory(cfg.env), renderer, cfg.env, max_tokens)
        return {"eval/accuracy": result["accuracy"], "eval/first_turn": result["first_turn"]}
    result = await evaluate_task(generator, reward, examples, _eval_reward(cfg), max_tokens=max_tokens)
    return {"eval/accuracy": result["accuracy"]}


def _max_prompt_tokens(cfg: GRPOConfig, model_dir: str) -> int:
    """Prompt tokens that leave room for max_tokens in the engine's max_model_len (default: the model's)."""
    limit = cfg.generator.engine_args.get("max_model_len")
    if limit is None:
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
        limit = model_config["max_position_embeddings"]
    response = cfg.env.max_total_tokens if cfg.env.name is not None else cfg.generator.sampling.get("max_tokens", 16)
    room = int(limit) - int(response)
    if room < 1:
        raise ConfigError(f"generator.sampling.max_tokens={cfg.generator.sampling.get('max_tokens')} leaves no room "
                          f"for a prompt in max_model_len={limit} (generator.engine_args.max_model_len)")
    return room


def _step_metrics(run, step, metrics, push, updates, buf, last_buf, staleness, sample_wait, step_s, gen_tokens,
                  gen_stats, data_stats, eval_scores) -> dict[str, float]:
    rewards, parts = run.rollouts.take_rewards()
    line = {
        "reward/mean": statistics.mean(rewards) if rewards else math.nan,
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        **{f"reward/{k}": statistics.mean(v) for k, v in parts.items() if v},
        "train/accuracy": statistics.mean(parts.get("exact_match") or parts.get("solved") or [math.nan]),
        "trainer/loss": metrics["loss"], "trainer/grad_norm": metrics["grad_norm"],
        "trainer/clip_fraction": metrics["clip_fraction"], "trainer/approx_kl": metrics["approx_kl"],
        "trainer/kl_ref": metrics["kl_ref"], "trainer/reverse_kl_teacher": metrics["reverse_kl_teacher"],
        "trainer/entropy": metrics["entropy"], "trainer/tokens_per_s": metrics["tokens_per_s"],
        "trainer/step_s": metrics["step_s"], "trainer/skipped_steps": metrics["skipped_steps"],
        "batch/staleness": staleness,
        "batch/staleness_max_run": run.max_staleness,
        "sync/push_s": push["push_s"],
        "sync/bytes": push["bytes"],  # one version as published: the whole policy, or the LoRA adapter alone
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
    for reason, count in _drops(buf, run, data_stats).items():
        line[f"drops/{reason}"] = count
    line["data/epoch"] = data_stats["epoch"]
    if eval_scores is not None:
        line.update(eval_scores)
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
    if m.get("trainer/reverse_kl_teacher"):
        parts.insert(3, f"KL to teacher {m['trainer/reverse_kl_teacher']:.3f}")
    if "eval/accuracy" in m:
        parts.append(f"EVAL {m['eval/accuracy']:.1%}")
        if "eval/first_turn" in m:
            parts.append(f"on the first turn {m['eval/first_turn']:.1%}")
    if drops:
        parts.append(f"drops {drops}")
    return " | ".join(parts)


def run_from_command_line(schema, app_main, description: str) -> None:
    """`python -m apps.<algorithm>.main --config FILE key=value ...`: parse, run, and end with a one-line error
    for what a user can fix (config, a dead role) or exit code 130 when interrupted."""
    config = parse_args(schema, description=description)
    handle_stop_signals()
    try:
        asyncio.run(app_main(config))
    except (ConfigError, RoleDied) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:
        raise SystemExit(130)


CONFIG = GRPOConfig  # what `python -m forge_rl.controller.launcher submit` reads

if __name__ == "__main__":
    run_from_command_line(GRPOConfig, main, __doc__.splitlines()[0])
