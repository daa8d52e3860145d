"""What a GRPO run reports per step (forge_rl/recipes/grpo_report.py), without starting a run."""

import math

import torch

from forge_rl.recipes.grpo_report import StepRecord, batch_rewards, console_line, shown_reward, step_metrics
from forge_rl.types import Completion, Episode, TrainBatch

TRAINER_KEYS = (
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


def trained_batch(rewards: list[float]) -> TrainBatch:
    """A batch as the replay buffer collates it: one episode per reward, scored by the rollout that made it."""
    episodes = [
        Episode(
            Completion(
                prompt_ids=torch.tensor([1, 2]),
                response_ids=torch.tensor([3, 4]),
                logprobs=torch.tensor([-0.5, -0.5]),
                policy_versions=torch.tensor([0, 0]),
                finish_reason="stop",
            ),
            reward=r,
            advantage=r - 0.5,
        )
        for r in rewards
    ]
    return TrainBatch.collate(episodes, pad_id=0)


def record(rewards: list[float], batches: list[TrainBatch]) -> StepRecord:
    return StepRecord(
        step=3,
        trainer={k: 0.0 for k in TRAINER_KEYS},
        push={"push_s": 0.1, "bytes": 10},
        updates=None,
        buffer={"groups": 1, "add_blocked_s": 0.0},
        buffer_before={"add_blocked_s": 0.0},
        staleness=1.0,
        max_staleness=1,
        sample_wait_s=0.0,
        step_s=1.0,
        generated_tokens=0,
        generator={"policy_version": 2},
        data={"epoch": 0},
        drops={},
        rewards=rewards,
        reward_parts={"exact_match": rewards} if rewards else {},
        batch_rewards=batch_rewards(batches),
    )


def test_a_step_trained_on_earlier_rollouts_shows_the_trained_batchs_reward_not_nan():
    """Async mode: no group finished during the step (its rollout reward list is empty), the batch came from
    groups scored before it. The console shows that batch's reward, never "reward nan"."""
    m = step_metrics(record([], [trained_batch([1.0, 0.0]), trained_batch([1.0, 1.0])]))
    assert math.isnan(m["reward/mean"])  # the metric keeps its meaning: groups scored during the step
    assert m["batch/reward_mean"] == 0.75
    line = console_line(3, m)
    assert "nan" not in line and "reward 0.75±0.43" in line and "acc -" in line, line


def test_the_console_reward_is_the_trained_batchs_or_blank():
    scored_now = step_metrics(record([0.0, 0.0], [trained_batch([1.0, 1.0])]))
    assert shown_reward(scored_now) == "1.00±0.00"  # what the step trained on, not what was scored meanwhile
    nothing = step_metrics(record([], [dataclass_without_rewards(trained_batch([1.0]))]))
    assert "batch/reward_mean" not in nothing and shown_reward(nothing) == "-"
    assert "reward - |" in console_line(3, nothing)


def dataclass_without_rewards(batch: TrainBatch) -> TrainBatch:
    """A batch made by hand without rewards (TrainBatch's own constructor, as a notebook or a test may)."""
    batch.rewards = None
    return batch
