"""PPO's pieces against values worked out by hand: GAE, whitening, the clipped value loss and its gradient,
per-token advantages in the policy loss, the run's advantage stage and its config errors."""

import math

import pytest
import torch

from forge_rl.actors.batch_checks import validate_batches
from forge_rl.config import ConfigError
from forge_rl.losses.config import LossConfig
from forge_rl.losses.grpo import per_token_loss
from forge_rl.losses.ppo import explained_variance, gae, terminal_rewards, value_loss, whiten
from forge_rl.recipes.ppo import PPO, with_advantages
from forge_rl.recipes.rl_run import RLRun
from forge_rl.recipes.ppo_config import GAEConfig, PPOConfig
from forge_rl.types import TrainBatch


def test_terminal_reward_sits_on_the_last_model_token():
    mask = torch.tensor([[False, True, True, False], [False, True, False, True]])  # row 1: an env token at 2
    r = terminal_rewards(torch.tensor([2.0, -1.0]), mask)
    assert r.tolist() == [[0, 0, 2.0, 0], [0, 0, 0, -1.0]]
    with pytest.raises(ValueError, match="no model tokens"):
        terminal_rewards(torch.tensor([1.0]), torch.zeros(1, 3, dtype=torch.bool))


def test_gae_by_hand():
    # one prompt token, three model tokens with values 0.5, 0.2, 0.8, reward 1 at the end; gamma 0.9, lambda 0.5
    mask = torch.tensor([[False, True, True, True]])
    values = torch.tensor([[9.0, 0.5, 0.2, 0.8]])  # the prompt's value is never read
    rewards = terminal_rewards(torch.tensor([1.0]), mask)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    d3 = 1.0 - 0.8  # r + gamma * 0 - V3 (the episode ends)
    d2 = 0.0 + 0.9 * 0.8 - 0.2
    d1 = 0.0 + 0.9 * 0.2 - 0.5
    a3 = d3
    a2 = d2 + 0.45 * a3
    a1 = d1 + 0.45 * a2
    assert adv[0].tolist() == pytest.approx([0.0, a1, a2, a3])
    assert ret[0].tolist() == pytest.approx([0.0, a1 + 0.5, a2 + 0.2, a3 + 0.8])


def test_gae_skips_an_environments_tokens_and_lambda_one_is_the_return_minus_the_value():
    # model, env, env, model: the env tokens are context, so token 3 is the step after token 0
    mask = torch.tensor([[True, False, False, True]])
    values = torch.tensor([[0.3, 7.0, 7.0, 0.6]])
    adv, ret = gae(terminal_rewards(torch.tensor([1.0]), mask), values, mask, gamma=0.5, lam=1.0)
    # lambda 1: A_t = discounted return - V_t; the return of token 0 is gamma * 1 (one model step later)
    assert adv[0].tolist() == pytest.approx([0.5 - 0.3, 0.0, 0.0, 1.0 - 0.6])
    assert ret[0].tolist() == pytest.approx([0.5, 0.0, 0.0, 1.0])


def test_whiten_uses_one_mean_and_std_over_every_batch():
    a = [torch.tensor([[1.0, 2.0, 99.0]]), torch.tensor([[3.0, 4.0]])]
    m = [torch.tensor([[True, True, False]]), torch.tensor([[True, True]])]
    w = whiten(a, m)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = ((x - x.mean()) / x.std(unbiased=False)).tolist()
    assert w[0][0, :2].tolist() + w[1][0].tolist() == pytest.approx(expected, abs=1e-6)
    assert w[0][0, 2] == 0.0  # outside the mask


def test_value_loss_clips_against_the_old_values_and_its_gradient():
    old = torch.tensor([[1.0, 1.0, 1.0]])
    ret = torch.tensor([[2.0, 0.0, 2.0]])
    v = torch.tensor([[1.5, 1.5, 0.5]], requires_grad=True)  # each moved 0.5 from the old values
    loss, clipped = value_loss(v, old, ret, value_clip=0.2)
    # token 0: V 1.5 -> (1.5-2)^2 = 0.25; clipped 1.2 -> 0.64: the larger, the clipped: no gradient
    # token 1: (1.5-0)^2 = 2.25; clipped 1.2 -> 1.44: the unclipped is larger: gradient V - R = 1.5
    # token 2: (0.5-2)^2 = 2.25; clipped 0.8 -> 1.44: unclipped: gradient V - R = -1.5
    assert loss[0].tolist() == pytest.approx([0.5 * 0.64, 0.5 * 2.25, 0.5 * 2.25])
    assert clipped[0].tolist() == [True, False, False]
    loss.sum().backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, 1.5, -1.5])
    plain, never = value_loss(v.detach(), old, ret, value_clip=0.0)
    assert plain[0].tolist() == pytest.approx([0.125, 1.125, 1.125]) and not never.any()


def test_explained_variance():
    mask = torch.ones(1, 4, dtype=torch.bool)
    r = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    assert explained_variance(r, r, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 0.5), r, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(r, torch.ones(1, 4), mask))


def test_per_token_advantages_give_each_token_its_own_gradient():
    lp = torch.zeros(1, 3, requires_grad=True)
    A = torch.tensor([[0.0, 2.0, -1.0]])
    loss, _ = per_token_loss(lp, torch.zeros(1, 3), A, LossConfig())
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -2.0, 1.0])  # -A_t * ratio (1) per token


def batch(rewards, mask) -> TrainBatch:
    B, T = mask.shape
    return TrainBatch(
        torch.randint(3, 100, (B, T)),
        mask,
        torch.zeros(B, T),
        torch.where(mask, 0, -1),
        torch.zeros(B),
        rewards=torch.tensor(rewards),
    )


def test_the_runs_advantage_stage_whitens_over_the_step_and_passes_validation():
    mask = torch.tensor([[False, True, True], [False, True, False]])
    batches = [batch([1.0, 0.0], mask), batch([0.5, 1.0], mask)]
    values = [torch.where(mask, 0.25, 0.0), torch.where(mask, 0.5, 0.0)]
    out, stats = with_advantages(batches, values, GAEConfig(gamma=1.0, lam=1.0))
    picked = torch.cat([b.advantages[b.response_mask] for b in out])
    assert picked.mean().abs() < 1e-6 and picked.std(unbiased=False) == pytest.approx(1.0, abs=1e-5)
    assert out[0].returns[0].tolist() == [0.0, 1.0, 1.0] and out[1].values is values[1]
    assert stats["critic/returns_mean"] == pytest.approx((1 + 1 + 0 + 0.5 + 0.5 + 1) / 6)
    validate_batches(out, 2, vocab_size=128, max_len=64)  # [B, T] advantages, values and returns are accepted
    bad = [out[0], TrainBatch(**{**vars(out[1]), "returns": torch.zeros(2, 5)})]
    with pytest.raises(ValueError, match=r"batch\[1\].returns has shape \(2, 5\), expected \(2, 3\)"):
        validate_batches(bad, 2, vocab_size=128, max_len=64)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(trainer={"loss": {"policy_loss": "gspo"}}), "policy_loss='gspo'"),
        (dict(overlong={"filter": True}), "overlong.filter"),
        (dict(critic={"model": "/nonexistent/critic"}), "critic.model"),
    ],
)
def test_ppo_config_errors_name_the_key(change, message, tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PPOConfig), {"output_dir": str(tmp_path), **change}))
    with pytest.raises(ConfigError, match=message):
        RLRun(cfg, PPO).prepare()
    with pytest.raises(ValueError, match="gae.gamma"):
        GAEConfig(gamma=0.0)


def test_one_sample_per_prompt_is_ppos_default_and_refused_for_grpo(tmp_path):
    """PPO's baseline is the critic, so group_size=1 is fine; GRPO's is the group's mean, so it learns nothing."""
    from omegaconf import OmegaConf

    from forge_rl.recipes.grpo_config import GRPOConfig

    ppo = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PPOConfig), {"output_dir": str(tmp_path / "p")}))
    assert ppo.group_size == 1
    RLRun(ppo, PPO).prepare()
    grpo = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(GRPOConfig), {"output_dir": str(tmp_path / "g"), "group_size": 1})
    )
    with pytest.raises(ConfigError, match=r"group_size=1: GRPO's advantage .* set group_size >= 2"):
        RLRun(grpo).prepare()


def test_the_critic_takes_the_trainers_placement_settings_and_its_own_optimizer():
    from omegaconf import OmegaConf

    from forge_rl.recipes.ppo import critic_config

    cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(PPOConfig),
            {
                "trainer": {"dtype": "bfloat16", "parallel": {"tp": 2}, "lora": {"rank": 8}, "checkpoint_dir": "/ck"},
                "critic": {"optim": {"lr": 3e-4}},
            },
        )
    )
    cfg.trainer.release_memory_after_step = True  # what the run sets when colocated on a GPU
    c = critic_config(cfg, "/models/rm")
    assert (c.model, c.optim.lr, c.checkpoint_dir) == ("/models/rm", 3e-4, "/ck/critic")
    assert c.dtype == "bfloat16" and c.parallel.tp == 2 and c.release_memory_after_step  # the trainer's
    assert not c.lora.enabled and cfg.trainer.lora.enabled  # LoRA is the policy's alone
