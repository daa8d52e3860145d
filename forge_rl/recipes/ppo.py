"""PPO with a critic: per-token credit from a value model trained beside the policy; no group of samples needed.

It is the RL run with a critic (the `PPO` algorithm value below; docs/algorithms.md):
- a `Critic` actor (forge_rl/actors/critic.py: the policy's TorchTitan body with a value head, its own optimizer,
  checkpoint and ranks) values every token of the step's batch under its current weights;
- GAE over the model tokens (an environment's tokens are skipped), with each episode's reward on its last model
  token, gives per-token advantages, whitened over the step, and the critic's targets (returns);
- the policy takes its usual optimizer step (the loss family unchanged: clip, IS corrections, KL) on the per-token
  advantages, then the critic takes `critic.epochs` steps of the clipped value loss while the weights publish.
Rollouts, the replay buffer and its staleness bound, weight sync without draining, evaluation, checkpoints (the
critic's in step-N/critic) and Slurm are GRPO's. Values are computed at train time, so a stale sample is valued
by the critic of the version being trained, not the one that sampled it.
"""

import asyncio
from dataclasses import replace
from pathlib import Path

import torch

from forge_rl.actors.critic import Critic
from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.config import ConfigError
from forge_rl.loop.ranks import Ranks
from forge_rl.losses.ppo import explained_variance, gae, terminal_rewards, whiten
from forge_rl.models import model_path
from forge_rl.models.lora_config import LoRAConfig
from forge_rl.recipes.algorithm import Algorithm, fill_reference
from forge_rl.recipes.rl_run import RLRun
from forge_rl.recipes.train import train
from forge_rl.recipes.ppo_config import GAEConfig, PPOConfig
from forge_rl.recipes.roles import Roles
from forge_rl.recipes.startup import on_trainer_procs
from forge_rl.recipes.step_state import StepState
from forge_rl.runtime.timeouts import within
from forge_rl.types import TrainBatch


def with_advantages(
    batches: list[TrainBatch], values: list[torch.Tensor], ppo: GAEConfig
) -> tuple[list[TrainBatch], dict[str, float]]:
    """Each batch with GAE's per-token advantages (whitened over the whole step when asked), the critic's values
    and its returns; and what the critic's values explain of the returns, before this step's update."""
    advantages, returns = [], []
    for b, v in zip(batches, values):
        if b.rewards is None:
            raise ValueError("PPO needs TrainBatch.rewards (each episode's reward), which TrainBatch.collate sets")
        a, r = gae(terminal_rewards(b.rewards, b.response_mask), v, b.response_mask, ppo.gamma, ppo.lam)
        advantages.append(a)
        returns.append(r)
    masks = [b.response_mask for b in batches]
    raw = torch.cat([a[m] for a, m in zip(advantages, masks)])
    if ppo.whiten_advantages:
        advantages = whiten(advantages, masks)
    out = [replace(b, advantages=a, values=v, returns=r) for b, a, v, r in zip(batches, advantages, values, returns)]
    all_values, all_returns = (torch.cat([t[m] for t, m in zip(ts, masks)]) for ts in (values, returns))
    stats = {
        "critic/explained_variance": explained_variance(
            all_values, all_returns, torch.ones_like(all_values, dtype=torch.bool)
        ),
        "critic/values_mean": float(all_values.mean()),
        "critic/returns_mean": float(all_returns.mean()),
        "critic/advantage_std": float(raw.std(unbiased=False)),
    }  # before whitening
    return out, stats


def critic_config(cfg: PPOConfig, model_dir: str) -> TrainerConfig:
    """The critic's trainer settings: the policy trainer's (parallelism, dtype, micro-batches, the colocated memory
    release, timeouts), with its own checkpoint, optimizer and directory, and never LoRA. Its routers choose their
    own experts (Keep Routing is about the policy's logprobs; a value has no behaviour to match)."""
    return replace(
        cfg.trainer,
        model=model_dir,
        optim=cfg.critic.optim,
        lora=LoRAConfig(),
        keep_routing=False,
        checkpoint_dir=str(Path(cfg.trainer.checkpoint_dir) / "critic"),
    )


def check(cfg: PPOConfig) -> None:
    """What GRPO allows and PPO's per-token advantages do not."""
    if cfg.overlong.filter:
        raise ConfigError(
            "overlong.filter zeroes group advantages; with PPO (per-token advantages from the "
            "critic) use overlong.penalty_cache_len, or leave truncated responses to the critic"
        )
    if cfg.trainer.loss.policy_loss == "gspo":
        raise ConfigError(
            "trainer.loss.policy_loss='gspo' clips a sequence ratio with one advantage per "
            "sequence; PPO's advantages are per token: use 'grpo' (PPO's clip) or 'cispo'"
        )
    critic_model(cfg)  # a model the critic can load, or a ConfigError naming critic.model


def critic_model(cfg: PPOConfig) -> str:
    return model_path(cfg.critic.model or cfg.model, "critic.model" if cfg.critic.model else "model", role="critic")


async def start_critic(cfg: PPOConfig, roles: Roles, placement, gpus: list[str]) -> Roles:
    """The critic, on the trainer's procs' hosts, cores and GPUs (time-sharing them, as the reference does)."""
    critic = await Critic.options(**on_trainer_procs(placement, gpus, cfg.trainer_procs), share_gpus=True).as_actor(
        critic_config(cfg, critic_model(cfg)), value_clip=cfg.critic.value_clip, epochs=cfg.critic.epochs
    )
    return roles.with_role("critic", await Ranks.of(critic))


async def score_with_critic(roles: Roles, state: StepState, batches: list, version: int) -> tuple[list, dict]:
    """The reference's logprobs, then the critic's values of every token and GAE's advantages from them."""
    batches, _ = await fill_reference(roles, state, batches, version)
    values = await within(
        asyncio.gather(*(rank.values.call_one(sent) for rank, sent in roles.critic.sending(batches))),
        state.cfg.timeouts.reference_s,
        "reference_s",
        f"the Critic's values for version {version}",
        state.where(),
    )
    return with_advantages(batches, roles.critic.per_batch(values), state.cfg.gae)


async def train_critic(roles: Roles, state: StepState, batches: list, version: int) -> dict:
    """The critic's steps on the batch's returns, after the policy's."""
    per_rank = await within(
        asyncio.gather(*(rank.step.call_one(sent) for rank, sent in roles.critic.sending(batches))),
        state.cfg.timeouts.trainer_step_s,
        "trainer_step_s",
        f"the Critic's step at version {version}",
        state.where(),
    )
    return {
        f"critic/{k}": per_rank[0][k]
        for k in ("value_loss", "value_loss_last_epoch", "value_clip_fraction", "grad_norm", "step", "step_s")
    }


PPO = Algorithm(
    "PPO",
    check=check,
    group_advantages=lambda cfg: False,  # the critic is the baseline: one sample per prompt is enough
    # the advantages the buffer sees are group-relative (0 with one sample per prompt); PPO's come later
    zero_advantage_trains="PPO's advantages come from the critic at train time",
    critic_model=critic_model,
    start_beside=start_critic,
    score=score_with_critic,
    train_beside=train_critic,
    trained_beside=("critic",),
)
CONFIG = PPOConfig
ALGORITHM = PPO


async def main(cfg: PPOConfig) -> dict:
    return await train(RLRun(cfg, PPO))
