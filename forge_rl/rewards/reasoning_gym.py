"""The reward of a reasoning-gym task (`task.source: reasoning_gym:NAME`): the task's own scorer, full credit or none.

    rewards:                             # the default for a reasoning-gym source; give it to change its args
      - {name: forge_rl.rewards.reasoning_gym:score_answer, args: {partial_credit: true}}

reasoning-gym's scorers give partial credit. Many give it to an answer that merely contains the right one (the
base scorer pays len(oracle) / len(answer) for "x46" against "46"), so a policy learns to pad its answers. Off by
default: a completion earns 1.0 when the scorer gives it full marks, else 0.0; `partial_credit: true` passes the
scorer's own value through.

The scorer is rebuilt in the reward worker from the row's `dataset` column (the task's name and config) and
judges the row's `entry`, as reasoning-gym's `score_answer(answer, entry)` expects (forge_rl/data/reasoning_gym.py
makes both).
"""

import dataclasses
import functools
import json

from forge_rl.data.sources import is_reasoning_gym_source
from forge_rl.rewards.reward_config import RewardConfig

SCORER = "forge_rl.rewards.reasoning_gym:score_answer"


def score_answer(
    prompts: list,
    completions: list[str],
    entry: list[dict],
    dataset: list[str],
    partial_credit: bool = False,
    answer_tag: str | None = "answer",
    **_,
) -> list[float]:
    """Each completion scored by its task's scorer. The answer is the text in the last <answer_tag>...</answer_tag>
    where the completion has one (reasoning-gym's prompts ask for it), else the whole completion, stripped."""
    scores = []
    for completion, item, spec in zip(completions, entry, dataset, strict=True):
        score = float(_scorer(spec)(given_answer(completion, answer_tag), item))
        scores.append(score if partial_credit else float(score >= 1.0))
    return scores


def given_answer(completion: str, answer_tag: str | None) -> str:
    if answer_tag:
        from reasoning_gym.utils import extract_answer

        tagged = extract_answer(completion, tag_name=answer_tag)
        if tagged is not None:
            return tagged
    return completion.strip()


@functools.lru_cache(maxsize=64)
def _scorer(spec: str):
    """The task's `score_answer`, its dataset made once per worker and config."""
    from reasoning_gym import create_dataset

    task = json.loads(spec)
    return create_dataset(task["name"], **task["config"]).score_answer


def task_rewards(cfg) -> list[RewardConfig]:
    """A run's rewards: a reasoning-gym task's scorer where the run's `rewards` are left at their default (exact
    match and a digits format, which judge the built-in sums, not a reasoning-gym task); else the rewards given."""
    if not is_reasoning_gym_source(cfg.task.source):
        return cfg.rewards
    default = next(f for f in dataclasses.fields(cfg) if f.name == "rewards").default_factory()
    return [RewardConfig(SCORER)] if cfg.rewards == default else cfg.rewards
