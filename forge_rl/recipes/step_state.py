"""What the RL step reads and moves on besides the roles: the config, the state the rollout tasks share with it,
the rollouts and weight sync in flight, the timeline and the metrics log.

    state = StepState(cfg, shared, rollouts, weights, timeline, log, colocated=False, where=run_where)
    line = await rl_step(roles, state, algorithm)          # forge_rl/recipes/rl_step.py

A run (forge_rl/recipes/rl_run.py) makes one at start and hands it to every step; an algorithm's hooks read their
settings and timeouts from it.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from forge_rl.loop.rollout_tasks import RolloutTasks
from forge_rl.loop.train_loop import RunState
from forge_rl.loop.weight_sync import WeightSync
from forge_rl.observability import MetricsLogger
from forge_rl.observability.timeline import Timeline


@dataclass
class StepState:
    cfg: Any  # GRPOConfig, or PPO's or distillation's (which derive from it)
    shared: RunState  # with the rollout tasks: the policy version, admission, drops, counters
    rollouts: RolloutTasks  # the tasks that generate, score and buffer groups beside every step
    weights: WeightSync  # the generators' swap and the reference's load in flight
    timeline: Timeline
    log: MetricsLogger
    colocated: bool  # the trainer shares its device with the generators (they step aside for its step)
    where: Callable[[], str]  # where the roles run and their logs, for a timeout's message
    buffer_stats: dict | None = None  # the replay buffer's stats as the last step's line read them

    @property
    def version(self) -> int:
        """The policy version: training steps taken (a resumed run starts at its checkpoint's)."""
        return self.shared.version
