"""The Critic actor on the tiny model: FSDP2 and TP ranks match one proc, it learns the returns, and a checkpoint
resumes to the same value losses as the run that was never stopped."""

import asyncio
import dataclasses
import os
import signal

import pytest
import torch

from forge_rl.actors.critic import Critic
from forge_rl.actors.trainer_config import OptimizerConfig, ParallelConfig, TrainerConfig
from forge_rl.loop.ranks import Ranks
from forge_rl.losses.ppo import gae, terminal_rewards
from forge_rl.runtime import stop_actor
from tests.support.actors import Echo
from tests.integration.test_trainer import make_batch, split


def critic(loop, tmp_path, procs: int = 1, epochs: int = 2, **parallel):
    cfg = TrainerConfig(
        model="tiny",
        parallel=ParallelConfig(**parallel),
        optim=OptimizerConfig(lr=1e-3),
        checkpoint_dir=str(tmp_path / "critic"),
    )
    return loop.run_until_complete(Critic.options(procs=procs, spmd=True).as_actor(cfg, value_clip=0.2, epochs=epochs))


async def each_rank(calls) -> list:
    """The calls' results in rank order, gathered in the loop that runs this (the test's own loop)."""
    return list(await asyncio.gather(*calls))


def valued(loop, actor, batches):
    """Each batch with its values from `actor` (each rank values its own) and GAE's returns; a row's reward is 1
    when its first token is even (a property of the row, so a split batch gets the same rewards)."""
    ranks = loop.run_until_complete(Ranks.of(actor))
    got = loop.run_until_complete(each_rank(rank.values.call_one(b) for rank, b in ranks.sending(batches)))
    out = []
    for b, v in zip(batches, ranks.per_batch(got)):
        rewards = (b.tokens[:, 0] % 2 == 0).float()
        a, r = gae(terminal_rewards(rewards, b.response_mask), v, b.response_mask)
        out.append(dataclasses.replace(b, advantages=a, values=v, returns=r))
    return out


def steps(loop, actor, n_dp: int, seeds) -> list[dict]:
    ranks = loop.run_until_complete(Ranks.of(actor))
    out = []
    for s in seeds:
        batches = valued(loop, actor, split(make_batch(s), n_dp))
        out.append(loop.run_until_complete(each_rank(rank.step.call_one(b) for rank, b in ranks.sending(batches)))[0])
    return out


def test_critic_on_fsdp_and_tp_ranks_matches_one_proc_and_learns_the_returns(loop, tmp_path):
    one = critic(loop, tmp_path / "one")
    first = loop.run_until_complete(one.values.call([make_batch(0)])).item(procs=0)[0]
    assert torch.all(first == 0)  # the value head starts at 0
    expected = steps(loop, one, 1, seeds=(0, 0, 0, 0))
    loop.run_until_complete(stop_actor(one))
    for parallel, n_dp in ((dict(dp_shard=2), 2), (dict(dp_shard=1, tp=2), 1)):  # TP: the head is replicated
        ranks = critic(loop, tmp_path / str(parallel), procs=2, **parallel)
        got = steps(loop, ranks, n_dp, seeds=(0, 0, 0, 0))
        loop.run_until_complete(stop_actor(ranks))
        for e, g in zip(expected, got):
            assert g["value_loss"] == pytest.approx(e["value_loss"], abs=1e-5), parallel
            assert g["grad_norm"] == pytest.approx(e["grad_norm"], abs=1e-4), parallel
    losses = [e["value_loss"] for e in expected]
    assert losses[-1] < 0.5 * losses[0], losses  # the same batch four times: it learns its returns
    # two epochs per step: the second's values moved from the first's, so the clip acts on some tokens
    assert expected[0]["step"] == 2 and any(e["value_clip_fraction"] > 0 for e in expected)


def test_critic_checkpoint_resumes_to_the_same_value_losses(loop, tmp_path):
    first = critic(loop, tmp_path, epochs=1)
    steps(loop, first, 1, seeds=(0,))
    path = loop.run_until_complete(first.save.call_one(None, str(tmp_path / "ckpt")))
    expected = steps(loop, first, 1, seeds=(1, 2))
    echo = first._forge_proc_mesh.spawn("echo", Echo)  # SIGKILL its proc: only the checkpoint survives
    _, pid = loop.run_until_complete(echo.who.call_one())
    os.kill(pid, signal.SIGKILL)
    second = critic(loop, tmp_path, epochs=1)
    assert loop.run_until_complete(second.load.call_one(path)) == 1
    got = steps(loop, second, 1, seeds=(1, 2))
    for e, g in zip(expected, got):
        assert g["value_loss"] == pytest.approx(e["value_loss"], abs=1e-7) and g["step"] == e["step"]
    assert expected[0]["value_loss"] != expected[1]["value_loss"]
    loop.run_until_complete(stop_actor(second))


@pytest.mark.parametrize("labels", [1, 2])
def test_a_critic_from_a_reward_models_checkpoint_starts_at_its_scores(loop, tmp_path, labels):
    """A Hugging Face sequence classifier as critic.model: the body is its body and the value of token t is its
    score head on the hidden state before t, as transformers computes it (two labels: label 1's logit minus
    label 0's)."""
    from transformers import Qwen3ForSequenceClassification

    from forge_rl.models import resolve_model_path

    torch.manual_seed(0)
    rm = Qwen3ForSequenceClassification.from_pretrained(resolve_model_path("tiny"), num_labels=labels)
    rm.score.weight.data.normal_(0, 0.5)  # a head that is not 0, so the check means something
    rm.save_pretrained(tmp_path / "rm")
    cfg = TrainerConfig(model=str(tmp_path / "rm"), checkpoint_dir=str(tmp_path / "critic"))
    actor = loop.run_until_complete(Critic.options(procs=1, spmd=True).as_actor(cfg))
    b = make_batch(3)
    values = loop.run_until_complete(actor.values.call([b])).item(procs=0)[0]
    with torch.no_grad():
        logits = rm.score(rm.model(b.tokens).last_hidden_state)  # [B, T, labels]: the score of every prefix
        scores = logits[..., 0] if labels == 1 else logits[..., 1] - logits[..., 0]
    expected = torch.where(b.response_mask, torch.cat([torch.zeros(b.num_sequences, 1), scores[:, :-1]], 1), 0.0)
    assert values.abs().max() > 0.1 and torch.allclose(values, expected, atol=1e-4)
    loop.run_until_complete(stop_actor(actor))
