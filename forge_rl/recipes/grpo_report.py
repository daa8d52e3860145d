"""What a GRPO run reports: one metrics line per step (`step_line`: the actors' stats gathered into a
`StepRecord`, then `step_metrics`), the console line of a step, and the summary at the end (`run_summary`, then
`summary_block`). Only `step_line` and `run_summary` call actors (their stats); the rest are pure functions of
what the run measured."""

import asyncio
import math
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge_rl.loop.train_loop import resume_hint


@dataclass
class StepRecord:
    """Everything measured about one training step, as the run collected it."""

    step: int
    trainer: dict  # Trainer.step's metrics
    push: dict  # the publish's timing and bytes (Trainer.step's metrics['publish'])
    updates: list[dict] | None  # the newest finished generator weight update (one dict per replica)
    buffer: dict  # ReplayBuffer.stats after the step
    buffer_before: dict  # ... and after the step before (for per-step deltas)
    staleness: float  # mean (trainer version - generating version) over the batch's response tokens
    max_staleness: int  # over every batch of the run so far
    sample_wait_s: float  # how long the train loop waited for the batch
    step_s: float
    generated_tokens: int  # by the generators during this step
    generator: dict  # Generator.stats of one replica
    data: dict  # PromptDataset.stats
    drops: dict[str, int]  # every drop reason so far (buffer, rollouts, dataset)
    rewards: list[float] = field(default_factory=list)  # totals of the groups scored during the step
    reward_parts: dict[str, list[float]] = field(default_factory=dict)  # per reward function
    # totals of the episodes the step trained on: in async mode scored during earlier steps, so `rewards` can be
    # empty while the batch has rewards (and the console showed "reward nan")
    batch_rewards: list[float] = field(default_factory=list)
    eval_scores: dict | None = None  # when the step ended with an evaluation


def batch_rewards(batches) -> list[float]:
    """Each trained episode's total reward, over the step's TrainBatches (one per data-parallel rank)."""
    return [float(r) for b in batches if getattr(b, "rewards", None) is not None for r in b.rewards.tolist()]


def drops(buffer: dict, rollout_drops: dict[str, int], data: dict) -> dict[str, int]:
    """Every drop reason: the buffer's (episodes), the rollouts' (episodes; prompt_too_long in prompts) and the
    prompts the dataset skipped as too long for the engine."""
    merged = {**buffer["dropped"], **rollout_drops}
    merged["prompt_too_long"] = merged.get("prompt_too_long", 0) + data["too_long"]
    return merged


def step_metrics(r: StepRecord) -> dict[str, float]:
    """The metrics line of one step (metrics.jsonl, TensorBoard, W&B)."""
    parts = r.reward_parts
    line = {
        "reward/mean": statistics.mean(r.rewards) if r.rewards else math.nan,
        "reward/std": statistics.pstdev(r.rewards) if len(r.rewards) > 1 else 0.0,
        **{f"reward/{k}": statistics.mean(v) for k, v in parts.items() if v},
        "train/accuracy": statistics.mean(parts.get("exact_match") or parts.get("solved") or [math.nan]),
        **trainer_metrics(r.trainer),
        **(
            {"generator/routes_bytes_per_token": r.generator["routes_bytes_per_token"]}
            if r.generator.get("routes_bytes_per_token")
            else {}
        ),
        **(
            {
                "batch/reward_mean": statistics.mean(r.batch_rewards),
                "batch/reward_std": statistics.pstdev(r.batch_rewards),
            }
            if r.batch_rewards
            else {}
        ),
        "batch/staleness": r.staleness,
        "batch/staleness_max_run": r.max_staleness,
        "sync/push_s": r.push["push_s"],
        "sync/bytes": r.push["bytes"],  # one version as published: the whole policy, or the LoRA adapter alone
        "generator/tokens_per_s": r.generated_tokens / r.step_s if r.step_s else 0.0,
        "generator/policy_version": r.generator["policy_version"],
        "buffer/groups": r.buffer["groups"],
        "buffer/sample_wait_s": r.sample_wait_s,
        "buffer/add_blocked_s": r.buffer["add_blocked_s"] - r.buffer_before["add_blocked_s"],
        "step_s": r.step_s,
    }
    if "hold_s" in r.push:  # colocated: the generators stepped aside for the step (on GPU: sleep and wake)
        line["sync/hold_s"], line["sync/release_s"] = r.push["hold_s"], r.push["release_s"]
    if r.updates:
        line["sync/prefetch_s"] = max(u["prefetch_s"] for u in r.updates)
        line["sync/pause_s"] = max(u["pause_s"] for u in r.updates)
    line.update({f"drops/{reason}": count for reason, count in r.drops.items()})
    if r.generator.get("sampling_mask_bytes_per_token"):  # truncated sampling: what the kept sets cost
        line["generator/sampling_mask_bytes_per_token"] = r.generator["sampling_mask_bytes_per_token"]
    line["data/epoch"] = r.data["epoch"]
    if r.eval_scores is not None:
        line.update(r.eval_scores)
    return line


def trainer_metrics(t: dict) -> dict[str, float]:
    """The trainer's part of a step's line, from Trainer.step's metrics, as `trainer/<name>`."""
    return {
        **{
            f"trainer/{k}": t[k]
            for k in (
                "loss",
                "grad_norm",
                "clip_fraction",
                "approx_kl",
                "kl_ref",
                "reverse_kl_teacher",
                "entropy",
                "tokens_per_s",
                "step_s",
                "mfu",
                "skipped_steps",
                "mismatch_abs_mean",
                "mismatch_abs_max",
                "mismatch_k3",
            )
        },
        # the is_correction's weight and the share of tokens it truncated or masked (absent when off)
        **{f"trainer/{k}": t[k] for k in ("is_weight_mean", "is_corrected_fraction") if t.get("is_weight_mean")},
        # Keep Routing (trainer.keep_routing): the replayed (position, layer) pairs, the share the trainer's routers
        # would have routed elsewhere, and the share the expert layers received with the engine's experts
        **{f"trainer/{k}": v for k, v in t.items() if k.startswith("keep_routing/")},
    }


def shown_reward(m: dict[str, float]) -> str:
    """The reward a person reads for a step: the trained batch's (whenever its episodes were scored), else the
    groups scored during the step, else blank; never "nan"."""
    for mean, std in (("batch/reward_mean", "batch/reward_std"), ("reward/mean", "reward/std")):
        if math.isfinite(m.get(mean, math.nan)):
            return f"{m[mean]:.2f}±{m.get(std, 0.0):.2f}"
    return "-"


def console_line(step: int, m: dict[str, float]) -> str:
    drops_seen = ",".join(f"{k.split('/')[1]}={int(v)}" for k, v in m.items() if k.startswith("drops/") and v)
    parts = [
        f"step {step:4d}",
        f"reward {shown_reward(m)}",
        f"acc {m['train/accuracy']:.0%}" if math.isfinite(m["train/accuracy"]) else "acc -",
        f"stale {m['batch/staleness']:.2f}",
        f"gen {m['generator/tokens_per_s']:.0f} tok/s",
        f"train {m['trainer/tokens_per_s']:.0f} tok/s",
        f"push {m['sync/push_s']:.2f}s",
        f"pause {m.get('sync/pause_s', 0):.2f}s",
        f"buffer {int(m['buffer/groups'])}",
        f"wait sample {m['buffer/sample_wait_s']:.2f}s",
        f"add {m['buffer/add_blocked_s']:.2f}s",
    ]
    if "trainer/mismatch_abs_mean" in m:  # train/inference: |log pi - log mu| over the batch (docs/algorithms.md)
        parts.insert(3, f"mismatch {m['trainer/mismatch_abs_mean']:.1e}")
    if "critic/value_loss" in m:  # PPO: how well the critic predicts the returns before its update
        parts.insert(3, f"value loss {m['critic/value_loss']:.3f} ev {m['critic/explained_variance']:.2f}")
    if m.get("trainer/reverse_kl_teacher"):
        parts.insert(3, f"KL to teacher {m['trainer/reverse_kl_teacher']:.3f}")
    if "eval/accuracy" in m:
        parts.append(f"EVAL {m['eval/accuracy']:.1%}")
        if "eval/first_turn" in m:
            parts.append(f"on the first turn {m['eval/first_turn']:.1%}")
    if drops_seen:
        parts.append(f"drops {drops_seen}")
    return " | ".join(parts)


def summary_block(
    summary: dict,
    eval_reward: str,
    out: Path,
    png: Path,
    checkpoint: Path,
    export_dir: str | None,
    lora: bool,
    log_dir: Path | None,
) -> str:
    """What a person wants to see at the end of a run, and where everything is."""
    buf, done = summary["buffer"], summary["steps"] - summary["start_step"]
    drops_seen = ", ".join(
        f"{reason} {n}" for reason, n in sorted(summary["drops"].items(), key=lambda kv: -kv[1]) if n
    )
    last = len(summary["evals"][-3:])
    rows = [
        (
            "steps",
            f"{done} (to step {summary['trainer_version']}) in {summary['wall_s']:.0f} s of training, "
            f"{summary['steps_per_min']:.1f} steps/min (start-up and evaluations excluded)",
        ),
        (
            "held-out",
            f"{summary['eval_first']:.1%} -> {summary['eval_last3_mean']:.1%} "
            f"({eval_reward}, mean of the last {last} evaluations)"
            if last
            else "not evaluated",
        ),
        (
            "episodes",
            f"{buf['added']} reached the buffer, {buf['trained']} trained, {buf['present']} still in it; "
            f"stale {summary['stale_fraction']:.1%} of generated",
        ),
        ("drops", drops_seen or "none"),
        *(
            [
                (
                    "mismatch",
                    f"|log pi - log mu| {summary['mismatch_abs_mean']:.1e} mean over steps, "
                    f"{summary['mismatch_abs_max']:.1e} max (train/inference; docs/algorithms.md)",
                )
            ]
            if summary.get("mismatch_abs_mean") is not None
            else []
        ),
        ("generators", f"policy versions {summary['generator_versions']}, {summary['generator_respawns']} respawned"),
        ("curves", str(png)),
        *(
            [
                (
                    "timeline",
                    f"{out / 'timeline.png'}, {out / 'timeline.json'} (Perfetto); busy: "
                    + ", ".join(f"{lane} {f:.0%}" for lane, f in summary["busy_fraction"].items()),
                )
            ]
            if "busy_fraction" in summary
            else []
        ),
        ("metrics", f"{out / 'metrics.jsonl'}, {out / 'tensorboard'}, {out / 'summary.json'}"),
        ("checkpoint", f"{checkpoint} (resume=true continues from it)"),
        *([("model", f"{export_dir} (HF format: vLLM, transformers, model=...)")] if export_dir else []),
        *([("adapter", f"{export_dir}/adapter (PEFT LoRA: peft, vLLM --lora-modules)")] if export_dir and lora else []),
    ]
    if log_dir:
        rows.append(("logs", f"{log_dir}/ (vLLM, TorchTitan, Monarch)"))
    width = max(len(k) for k, _ in rows)
    return "[bold green]done[/bold green]\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


async def step_line(
    roles,
    s,
    metrics: dict,
    push: dict,
    batches: list,
    buffer_before: dict,
    staleness: float,
    sample_wait: float,
    step_s: float,
    generated_tokens: int,
) -> tuple[dict[str, float], dict]:
    """The metrics line of the step just taken (to version `s.version`, of the run's RunState `s`): what the
    trainer and the publish returned, with the buffer's, the dataset's and a generator's stats and the rewards
    scored meanwhile; and the buffer's stats it read (the next step's `buffer_before`)."""
    # the three roles' stats at once: one round trip's wait on the step's critical path, not three
    buffer, data, replicas = await asyncio.gather(
        roles.buffer.stats.call_one(), roles.dataset.stats.call_one(), roles.generator.stats.call_all()
    )
    generator = replicas[0] if replicas else await roles.generator.stats.route()  # every replica was respawning
    rewards, parts = s.rollouts.take_rewards()
    line = step_metrics(
        StepRecord(
            step=s.version,
            trainer=metrics,
            push=push,
            updates=s.last_updates,
            buffer=buffer,
            buffer_before=buffer_before,
            staleness=staleness,
            max_staleness=s.max_staleness,
            sample_wait_s=sample_wait,
            step_s=step_s,
            generated_tokens=generated_tokens,
            generator=generator,
            data=data,
            drops=drops(buffer, s.drops, data),
            rewards=rewards,
            reward_parts=parts,
            batch_rewards=batch_rewards(batches),
        )
    )
    line.update({k: v for k, v in metrics.items() if "/" in k})  # another stage's, named (PPO's critic/...)
    if replicas and (busy := engines_busy(s, replicas)) is not None:
        line["generator/busy"] = busy
    return line, buffer


def engines_busy(s, replicas: list[dict]) -> float | None:
    """The share of the time since the last read (the last step's) that the generator replicas' engines had
    requests in them, their mean: whoever sent the requests (rollouts, an agent gateway). None at the first read."""
    now, busy_s = time.perf_counter(), sum(r["busy_s"] for r in replicas) / len(replicas)
    last, s.engines_read = s.engines_read, (now, busy_s)
    if last is None or now <= last[0]:
        return None
    return min(1.0, max(0.0, (busy_s - last[1]) / (now - last[0])))  # a respawned replica starts again at 0


async def run_summary(run, wall: float, gen_busy_s: float) -> dict:
    """The run's summary (summary.json): steps and their rate over `wall` seconds of training, evaluations,
    versions, staleness, train/inference mismatch, idle fractions, the buffer's and the data's final counts."""
    s = run.state
    final_buffer = await run.roles.buffer.stats.call_one()  # read only: what is still buffered stays (`present`)
    data = await run.roles.dataset.stats.call_one()
    last3 = [acc for *_, acc in run.evals[-3:]]
    generated = final_buffer["added"] + sum(n for k, n in s.drops.items() if k.startswith("reward_"))
    done = run.step - run.start_step
    return dict(
        steps=run.step,
        start_step=run.start_step,
        wall_s=wall,
        steps_per_min=done / wall * 60 if wall else 0.0,
        eval_first=run.evals[0][2] if run.evals else None,
        eval_last3_mean=statistics.mean(last3) if last3 else None,
        evals=run.evals,
        time_to_60=next((t for _, t, acc in run.evals if acc >= 0.6), None),
        generator_version=await run.roles.generator.version.route(),
        generator_versions=await run.roles.generator.version.call_all(),  # every replica, respawned ones included
        trainer_version=s.version,
        generator_respawns=run.roles.generator.service_stats.respawns,
        max_staleness=s.max_staleness,
        mean_staleness=s.staleness_sum / max(s.staleness_steps, 1),
        mismatch_abs_mean=statistics.mean(m for m, _ in s.mismatch) if s.mismatch else None,
        mismatch_abs_max=max((x for _, x in s.mismatch), default=None),
        trainer_idle_fraction=1 - s.trainer_busy_s / wall if wall else 0.0,
        generator_idle_fraction=1 - gen_busy_s / wall if wall else 0.0,
        generator_stats=await run.roles.generator.stats.route(),
        admission_wait_s=s.admission.wait_s,
        placement=run.placement.describe(),
        stale_fraction=final_buffer["dropped"]["stale"] / max(generated, 1),
        mean_running_sequences=run.engine_occupancy,
        partial_rollouts=s.rollouts.partial_rollouts(),
        buffer=final_buffer,
        drops=drops(final_buffer, s.drops, data),
        data=data,
    )


def occupancy(before: dict, after: dict) -> float:
    """The engine's mean batch occupancy between two Generator.stats of one replica: sequences in it (running or
    queued), averaged over the time it generated (evaluations in between included)."""
    if not before:  # no rollout started
        return 0.0
    busy = after["busy_s"] - before["busy_s"]
    return (after["sequence_s"] - before["sequence_s"]) / busy if busy > 0 else 0.0


def eval_reward_name(cfg) -> str:
    """What the held-out accuracy counts, in words: an environment solved, an agent's reward, or the reward named."""
    if cfg.env.name is not None:
        return f"solved within {cfg.env.max_turns} turns ({cfg.env.name})"
    if cfg.agent.enabled:
        scored_by = cfg.task.eval_reward or cfg.rewards[0].name
        return f"solved by agent {cfg.agent.name} (its reward > 0, or {scored_by})"
    return cfg.task.eval_reward or cfg.rewards[0].name


def where_roles_run(launcher, log_dir, checkpoint_dir, claim) -> str:
    """For a timeout's message: where the roles run, their logs, and where to resume (`claim`: the run's claim on its
    output folder, None before it has one)."""
    hosts = (
        f"the roles run on Slurm job nodes (trainer: {launcher.slurm.trainer_nodes}, generators: "
        f"{launcher.slurm.generator_nodes})"
        if launcher.kind == "slurm"
        else f"the roles run on host {socket.gethostname()}"
    )
    logs = f", their output in {log_dir}/" if log_dir else ""
    return f"{hosts}{logs}; {resume_hint(checkpoint_dir, claim.run_id if claim else None)}"
