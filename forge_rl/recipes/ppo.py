"""PPO with a critic: per-token credit from a value model trained beside the policy; no group of samples needed.

It is the GRPO run with a critic stage (docs/algorithms.md):
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

from dataclasses import replace
from pathlib import Path

import torch

from forge_rl.actors.critic import Critic
from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.config import ConfigError
from forge_rl.loop.train_loop import batches_for_ranks, call_each_rank, call_for_batches, data_shards
from forge_rl.losses.ppo import explained_variance, gae, terminal_rewards, whiten
from forge_rl.models import model_path
from forge_rl.models.lora_config import LoRAConfig
from forge_rl.recipes.grpo import GRPORun
from forge_rl.recipes.train import train
from forge_rl.recipes.ppo_config import GAEConfig, PPOConfig
from forge_rl.recipes.roles import Roles
from forge_rl.recipes.startup import on_trainer_procs
from forge_rl.runtime.memory_plan import ModelShape
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


class PPORun(GRPORun):
    """A GRPO run with a critic stage."""

    cfg: PPOConfig

    def prepare(self) -> None:
        cfg = self.cfg
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
        super().prepare()
        self.critic_model = model_path(
            cfg.critic.model or cfg.model, "critic.model" if cfg.critic.model else "model", role="critic"
        )

    def group_advantages(self) -> bool:
        return False  # the critic is the baseline: one sample per prompt is enough

    def zero_advantage_trains(self) -> str:
        # the advantages the buffer sees are group-relative (0 with one sample per prompt); PPO's come later
        return "PPO's advantages come from the critic at train time"

    def critic_parameters(self) -> int:
        return ModelShape.from_config(self.critic_model).parameters()

    def other_trained(self) -> dict:
        critic = self.roles.critic if self.roles is not None else None
        return {"critic": critic} if critic is not None else {}

    async def start_actors(self, hosts: dict, gpus: list[str]) -> Roles:
        roles = await super().start_actors(hosts, gpus)
        # on the trainer's procs' hosts, cores and GPUs (time-sharing them, as the reference does)
        critic = await Critic.options(
            **on_trainer_procs(self.placement, gpus, self.cfg.trainer_procs), share_gpus=True
        ).as_actor(
            critic_config(self.cfg, self.critic_model),
            value_clip=self.cfg.critic.value_clip,
            epochs=self.cfg.critic.epochs,
        )
        return roles.with_role("critic", critic, await data_shards(critic))

    async def score(self, batches: list, version: int) -> tuple[list, dict]:
        """The reference's logprobs, then the critic's values of every token and GAE's advantages from them."""
        batches, _ = await super().score(batches, version)
        values = await within(
            call_for_batches(self.roles.critic, Critic.values, batches, self.roles.shards["critic"]),
            self.cfg.timeouts.reference_s,
            "reference_s",
            f"the Critic's values for version {version}",
            self._where(),
        )
        return with_advantages(batches, values, self.cfg.gae)

    async def train_beside(self, batches: list, version: int) -> dict:
        """The critic's steps on the batch's returns, after the policy's."""
        critic = (
            await within(
                call_each_rank(self.roles.critic, Critic.step, batches_for_ranks(batches, self.roles.shards["critic"])),
                self.cfg.timeouts.trainer_step_s,
                "trainer_step_s",
                f"the Critic's step at version {version}",
                self._where(),
            )
        )[0]
        return {
            f"critic/{k}": critic[k]
            for k in ("value_loss", "value_loss_last_epoch", "value_clip_fraction", "grad_norm", "step", "step_s")
        }


CONFIG = PPOConfig


async def main(cfg: PPOConfig) -> dict:
    return await train(PPORun(cfg))
