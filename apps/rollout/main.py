"""Rollouts end to end: prompts -> generator service (vLLM) -> rewards -> group advantages -> TrainBatch,
then a check that the behaviour logprobs vLLM recorded equal TorchTitan's logprobs of the same tokens.

    python -m apps.rollout.main --config configs/rollout/tiny.yaml [key=value ...]

This is the path the GRPO app drives every step, minus the trainer; with the random-init tiny model
the reward is ~0 (it has not learned arithmetic yet), which is expected.
"""

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from forge_rl.actors.generator import Generator
from forge_rl.config import parse_args, to_yaml
from forge_rl.controller import provisioned
from forge_rl.data.arithmetic import chat_prompt, problems
from forge_rl.losses.advantages import group_advantages
from forge_rl.models import resolve_model_path
from forge_rl.rewards.exact_match import exact_match
from forge_rl.types import Episode, Group, TrainBatch


@dataclass
class RolloutConfig:
    model: str = "tiny"
    replicas: int = 1
    num_prompts: int = 32
    group_size: int = 8
    concurrency: int = 8  # rollout tasks in flight at once
    seed: int = 0
    output_dir: str = "outputs/rollout"
    check_logprobs: bool = True
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM AsyncEngineArgs
    sampling: dict[str, Any] = field(default_factory=lambda: dict(temperature=1.0, max_tokens=8))


async def rollout(generator, tokenizer, problem, group_size) -> Group:
    completions = await generator.generate.route(chat_prompt(tokenizer, problem), n=group_size)
    texts = [c.text for c in completions]
    rewards = exact_match([problem.question] * len(texts), texts, answer=[problem.answer] * len(texts))
    advantages = group_advantages(rewards)
    episodes = [
        Episode(c, reward=r, rewards={"exact_match": r}, advantage=a, target=problem.answer)
        for c, r, a in zip(completions, rewards, advantages)
    ]
    return Group(problem.id, episodes)


def titan_logprob_gap(model_dir: str, groups: list[Group], pad_id: int) -> float:
    """Max |vLLM behaviour logprob - TorchTitan log_softmax| over all response tokens."""
    from forge_rl.models.qwen3 import build_model

    model, _ = build_model(model_dir)
    batch = TrainBatch.collate([e for g in groups for e in g.episodes], pad_id=pad_id)
    with torch.no_grad():
        logp = torch.log_softmax(model(batch.tokens).float(), dim=-1)
    # logits at position t predict token t+1
    token_logp = logp[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    mask = batch.response_mask[:, 1:]
    return (token_logp - batch.behaviour_logprobs[:, 1:]).abs()[mask].max().item()


async def main(cfg: RolloutConfig) -> dict[str, float]:
    from transformers import AutoTokenizer

    console = Console()
    model_dir = resolve_model_path(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))

    async with provisioned():
        t0 = time.perf_counter()
        console.print(f"starting {cfg.replicas} generator replica(s) on {model_dir} ...")
        generator = await Generator.options(replicas=cfg.replicas).as_service(
            model_dir, engine_args=cfg.engine_args, sampling=cfg.sampling, seed=cfg.seed
        )
        startup_s = time.perf_counter() - t0

        todo = problems(cfg.num_prompts, seed=cfg.seed)
        slots = asyncio.Semaphore(cfg.concurrency)

        async def one(problem):
            async with slots:
                return await rollout(generator, tokenizer, problem, cfg.group_size)

        t1 = time.perf_counter()
        groups = []
        for fut in tqdm(asyncio.as_completed([one(p) for p in todo]), total=len(todo), desc="rollouts", unit="group"):
            groups.append(await fut)
        rollout_s = time.perf_counter() - t1
        engine_stats = await generator.stats.call_all()

    rewards = torch.tensor([e.reward for g in groups for e in g.episodes])
    tokens = sum(len(e.completion.response_ids) for g in groups for e in g.episodes)
    summary = dict(
        groups=len(groups),
        episodes=int(rewards.numel()),
        reward_mean=rewards.mean().item(),
        startup_s=startup_s,
        rollout_s=rollout_s,
        groups_per_s=len(groups) / rollout_s,
        generated_tokens_per_s=tokens / rollout_s,
        engine_tokens_per_s=sum(s["tokens_per_s"] for s in engine_stats),
    )
    if cfg.check_logprobs:
        summary["max_logprob_gap_vllm_vs_torchtitan"] = titan_logprob_gap(model_dir, groups, tokenizer.pad_token_id)

    table = Table(title="forge_rl rollout")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        table.add_row(k, f"{v:.3g}" if isinstance(v, float) else str(v))
    console.print(table)
    sample = groups[0].episodes[0]
    console.print(f"sample: {sample.completion.prompt!r} -> {sample.completion.text!r} (answer {sample.target})")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"wrote {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    # Keep the console for forge_rl's own progress; procs spawned later inherit this.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    asyncio.run(main(parse_args(RolloutConfig, description=__doc__)))
