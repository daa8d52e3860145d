"""Held-out evaluation of an agent task: one evaluation episode per held-out example, greedy.

An evaluation episode has a base URL of its own, as a training one does, but it is never trained on: its calls
sample greedily (temperature 0) unless a request asks for other sampling, which is allowed there
(forge_rl/agents/requests.py). An example counts as solved when the agent's reward is above 0, or, when the agent
returns None, by the eval reward's value on its last reply (task.eval_reward, as for any task). An episode that
fails counts as not solved; the failures are returned, for the caller to report by cause (forge_rl/loop/eval.py:
one line per cause, not one per example).
"""

import asyncio

from forge_rl.actors.reward import RewardActor
from forge_rl.agents.entry import EpisodeFailed
from forge_rl.agents.rollout import AgentRunner
from forge_rl.deps.monarch import SupervisionError
from forge_rl.runtime.replies import replies


async def evaluate_agent(agents: AgentRunner, examples: list, reward, eval_reward: str) -> dict[str, float]:
    """{"accuracy": fraction solved, "reward": mean reward, "n", "failures": [(example id, reason, message)] of
    the episodes that failed, in the examples' order} over `examples`."""
    if not examples:
        raise ValueError("evaluate_agent: no held-out examples")

    failed: dict[int, tuple[str, str, str]] = {}

    async def one(i, example):
        try:
            return await agents.episode(example, trained=False)
        except SupervisionError:
            raise
        except EpisodeFailed as e:
            failed[i] = (example.id, e.reason, str(e))
            return None, None

    done = await asyncio.gather(*(one(i, e) for i, e in enumerate(examples)))
    failures = [failed[i] for i in sorted(failed)]  # in the examples' order, whichever failed first
    solved = [0.0 if record is None else float(r > 0) for record, r in done]
    rewards = [0.0 if r is None else r for _, r in done]
    unscored = [i for i, (record, r) in enumerate(done) if record is not None and r is None]
    if unscored:
        values = await _scored(reward, [examples[i] for i in unscored], [done[i][0] for i in unscored], eval_reward)
        for i, (total, value) in zip(unscored, values):
            rewards[i], solved[i] = total, value
    n = len(examples)
    return {"accuracy": sum(solved) / n, "reward": sum(rewards) / n, "n": n, "failures": failures}


async def _scored(reward, examples: list, records: list, eval_reward: str) -> list[tuple[float, float]]:
    """(total reward, eval reward) of each episode's last reply; (0, 0) for all when the reward functions fail."""
    names = sorted({k for e in examples for k in e.columns})
    try:
        totals, parts = await replies().call(
            reward,
            RewardActor.score,
            [e.prompt for e in examples],
            [r.final_text or "" for r in records],
            [r.final_finish for r in records],
            {k: [e.columns.get(k) for e in examples] for k in names},
        )
    except SupervisionError:
        raise
    except Exception as e:
        failure = getattr(e, "exception", e)
        print(f"evaluation: the reward functions failed on the agent's replies (scored 0): {failure}"[:300], flush=True)
        return [(0.0, 0.0)] * len(examples)
    return list(zip(totals, parts[eval_reward]))
