"""A short PPO run on the tiny model (apps/ppo): one sample per prompt, the critic's values and GAE every step,
the critic checkpointed beside the policy and resumed with it."""

import asyncio
import json
import math
from pathlib import Path

from forge_rl.config import load_config
from forge_rl.recipes.ppo import PPOConfig, main

REPO = Path(__file__).resolve().parents[2]  # tests/integration/ -> the repository
SMALL = [
    "batch_groups=8",
    "rollout_tasks=8",
    "eval_size=32",
    "eval_every=0",
    "buffer.capacity=16",
    "generator.sampling.max_tokens=6",
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ppo_run_with_one_sample_per_prompt_then_resume_with_its_critic(tmp_path):
    cfg = load_config(PPOConfig, REPO / "configs/ppo/tiny.yaml", SMALL + ["steps=3", f"output_dir={tmp_path}"])
    first = asyncio.run(main(cfg))
    assert first["trainer_version"] == 3 and first["generator_version"] == 3 and first["max_staleness"] <= 1
    # G = 1: every group's group-relative advantage is 0, and none is dropped for it (the critic's come later)
    assert first["drops"].get("zero_advantage", 0) == 0 and first["buffer"]["trained"] >= 3 * 8
    steps = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "critic/value_loss" in r]
    assert [r["critic/step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["critic/value_loss"]) and r["critic/value_loss"] > 0 for r in steps)
    assert steps[0]["critic/values_mean"] == 0.0 and steps[-1]["critic/values_mean"] != 0.0  # the head learns
    assert all(math.isfinite(r["trainer/loss"]) for r in steps)
    assert (tmp_path / "checkpoints/step-3/critic/.metadata").is_file()

    cfg = load_config(
        PPOConfig, REPO / "configs/ppo/tiny.yaml", SMALL + ["steps=4", f"output_dir={tmp_path}", "resume=true"]
    )
    second = asyncio.run(main(cfg))
    assert second["start_step"] == 3 and second["trainer_version"] == 4
    resumed = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "critic/value_loss" in r][-1]
    assert resumed["critic/step"] == 4  # the critic continued from its checkpoint, not from a fresh head
    assert resumed["critic/values_mean"] != 0.0


def test_multi_turn_ppo_values_the_models_turns_and_skips_the_environments_tokens(tmp_path):
    """PPO on the retry environment (configs/grpo/tiny_retry.yaml) with one trajectory per prompt: batches hold an
    environment's feedback inside the response, and GAE steps over it."""
    import forge_rl.recipes.ppo as ppo

    seen = []
    original = ppo.with_advantages

    def spy(batches, values, cfg):  # what the critic stage saw: the real batches of the run
        out, stats = original(batches, values, cfg)
        seen.extend(out)
        return out, stats

    ppo.with_advantages = spy
    try:
        cfg = load_config(
            PPOConfig,
            REPO / "configs/grpo/tiny_retry.yaml",
            SMALL + ["steps=2", "group_size=1", f"output_dir={tmp_path}", "export_dir=null"],
        )
        summary = asyncio.run(main(cfg))
    finally:
        ppo.with_advantages = original
    assert summary["trainer_version"] == 2
    env_tokens = 0
    for b in seen:
        inside = b.response_mask.cumsum(1) > 0  # from the first model token on
        after_last = b.response_mask.flip(1).cumsum(1).flip(1) == 0
        env = inside & ~after_last & ~b.response_mask  # an environment's tokens, between the model's turns
        env_tokens += int(env.sum())
        assert (b.values[env] == 0).all() and (b.advantages[env] == 0).all() and (b.returns[env] == 0).all()
        assert (b.returns[b.response_mask] != 0).any() or (b.rewards == 0).all()
    assert env_tokens > 0  # some trajectory was retried, so the environment's feedback was inside a response
