"""An RL algorithm as a value: what GRPO, PPO and on-policy distillation do differently in the one RL run.

    summary = await train(RLRun(cfg, PPO))       # forge_rl/recipes/train.py, forge_rl/recipes/rl_run.py

Each field is a builder or a hook over the run's config, roles and step state (TorchTitan's TrainSpec: parts
swapped as values, not subclass overrides). GRPO is the defaults; PPO (forge_rl/recipes/ppo.py) adds a critic that
scores and trains beside the policy; distillation (forge_rl/recipes/distill.py) swaps the reference for a teacher.
Everything else (rollouts, the buffer, the trainer's step, weight sync, evaluation, checkpoints, interrupts) is
the run's, the same for all.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from forge_rl.recipes.grpo_report import console_line, shown_reward
from forge_rl.recipes.rl_step import rl_step
from forge_rl.recipes.roles import Roles
from forge_rl.recipes.step_state import StepState
from forge_rl.runtime.timeouts import within


def kl_reference(cfg) -> str | None:
    """The starting policy, when the KL penalty needs its logprobs (trainer.loss.kl_coef > 0)."""
    return cfg.trainer.model if cfg.trainer.loss.kl_coef > 0 else None


async def fill_reference(roles: Roles, state: StepState, batches: list, version: int) -> tuple[list, dict]:
    """The batch with its reference (or teacher) logprobs filled in, when the run has a reference."""
    if roles.reference is None:
        return batches, {}
    ranks = roles.reference
    filled = await within(
        asyncio.gather(*(rank.fill_ref_logprobs.call_one(sent) for rank, sent in ranks.sending(batches))),
        state.cfg.timeouts.reference_s,
        "reference_s",
        f"the Reference's fill_ref_logprobs for version {version}",
        state.where(),
    )
    return ranks.per_batch(filled), {}


async def nothing_beside(roles: Roles, state: StepState, batches: list, version: int) -> dict:
    return {}


async def no_more_roles(cfg, roles: Roles, placement, gpus: list[str]) -> Roles:
    return roles


def _none(cfg) -> None:
    return None


def rl_postfix(run, line: dict) -> dict:
    """The progress bar's end for an RL step: the reward a person reads, and the latest held-out accuracy."""
    return dict(reward=shown_reward(line), acc=f"{run.evals[-1][2]:.0%}")


def _groups(cfg) -> bool:
    return True


Step = Callable[[Any, Any, "Algorithm"], Awaitable[dict]]
Score = Callable[[Roles, StepState, list, int], Awaitable[tuple[list, dict]]]
TrainBeside = Callable[[Roles, StepState, list, int], Awaitable[dict]]
StartBeside = Callable[[Any, Roles, Any, list[str]], Awaitable[Roles]]


@dataclass(frozen=True)
class Algorithm:
    name: str  # on the console, in the plots and the output's run.json: GRPO, PPO, Distill, SFT
    # one step of the run: step(run.roles, run.step_state, algorithm) -> the step's metrics line (train.py calls it)
    step: Step = rl_step
    console_line: Callable[[int, dict], str | None] = console_line  # a step's line on the console; None: none
    postfix: Callable[[Any, dict], dict] = rl_postfix  # the progress bar's end after a step: postfix(run, line)
    # the algorithm's own config checks, before any actor (a ConfigError in one line)
    check: Callable[[Any], None] = _none
    # whose logprobs fill TrainBatch.ref_logprobs every step: the KL's reference, a teacher, or None
    reference_model: Callable[[Any], str | None] = kl_reference
    # whether the advantage is relative to the group of a prompt's samples (it needs group_size >= 2)
    group_advantages: Callable[[Any], bool] = _groups
    # why a group whose rewards are all equal still carries a training signal (the buffer then keeps it)
    zero_advantage_trains: str | None = None
    # a model trained beside the policy on the trainer's procs (PPO's critic), for the colocated memory plan
    critic_model: Callable[[Any], str | None] = _none
    start_beside: StartBeside = no_more_roles  # roles more, started after the run's own (PPO's critic)
    score: Score = fill_reference  # the batch made ready to train: reference logprobs, values, advantages
    train_beside: TrainBeside = nothing_beside  # what trains while the policy's weights publish (the critic)
    trained_beside: tuple[str, ...] = ()  # Roles fields checkpointed and resumed with the policy ("critic")

    def others(self, roles: Roles) -> dict:
        """The roles trained beside the policy, by name, as checkpoints save and load them."""
        return {name: getattr(roles, name).mesh for name in self.trained_beside if getattr(roles, name) is not None}


GRPO = Algorithm("GRPO")
