"""Shared-prompt packing gives the same logprobs and gradients as row-by-row training, on the real
TorchTitan tiny model, for fewer tokens; and it packs only when that saves compute."""

import pytest
import torch

from forge_rl.data.prompt_packing import plan_packing
from forge_rl.losses.logprobs import selected_logprobs, token_logprobs
from forge_rl.models.qwen3 import build_model
from forge_rl.types import Completion, Episode, TrainBatch
from tests.conftest import TINY_MODEL


def _batch(prompts: list[list[int]], group_size: int, seed: int = 0, env_turns: bool = False) -> TrainBatch:
    """Groups of `group_size` responses of random lengths per prompt, collated as the buffer does. With
    `env_turns`, a run of tokens inside each response is an environment's (multi-turn), not the model's."""
    g = torch.Generator().manual_seed(seed)
    episodes = []
    for prompt in prompts:
        for _ in range(group_size):
            R = int(torch.randint(1 + 4 * env_turns, 9 + 8 * env_turns, (1,), generator=g))
            env_mask = None
            if env_turns:  # model tokens, then the environment's, then the model's again
                env_mask = torch.zeros(R, dtype=torch.bool)
                env_mask[2 : R - 2] = True
            c = Completion(
                torch.tensor(prompt),
                torch.randint(3, 128, (R,), generator=g),
                torch.zeros(R),
                torch.zeros(R, dtype=torch.long),
                "stop",
                env_mask=env_mask,
            )
            episodes.append(Episode(c, advantage=float(torch.randn(1, generator=g))))
    return TrainBatch.collate(episodes, pad_id=0)


def _prompts(lengths: list[int]) -> list[list[int]]:
    return [[5 + (7 * i + j) % 100 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def model():
    m, _ = build_model(TINY_MODEL)
    return m


def _logprobs(model, batch: TrainBatch, packed: bool, temperature: float = 0.7):
    if not packed:
        lp, ent = token_logprobs(model(batch.tokens), batch.tokens, temperature, entropy="grad")
        return lp * batch.response_mask, ent * batch.response_mask
    p = plan_packing(batch.tokens, batch.response_mask)
    assert p is not None
    logits = model(p.tokens, positions=p.positions, attention_masks=p.attention_mask)
    lp, ent = selected_logprobs(logits.flatten(0, 1)[p.pred_index], p.targets, temperature, entropy="grad")
    zeros = torch.zeros(batch.tokens.shape)
    keep = batch.response_mask
    return zeros.index_put((p.rows, p.cols), lp) * keep, zeros.index_put((p.rows, p.cols), ent) * keep


@pytest.mark.parametrize("env_turns", [False, True], ids=["single-turn", "multi-turn"])
def test_packed_rows_give_the_same_logprobs_entropy_and_gradients(model, env_turns):
    batch = _batch(_prompts([30, 22, 30]), group_size=8, env_turns=env_turns)
    if env_turns:  # the environment's tokens sit inside the responses and are no response tokens
        assert not batch.response_mask[0, 30 + 2] and batch.response_mask[0, 30]
    results = []
    for packed in (False, True):
        model.zero_grad()
        lp, ent = _logprobs(model, batch, packed)
        # a loss that weights every token differently, so any misplaced logprob shows in the gradient
        w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
        ((lp * w).sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert (lp0[batch.response_mask] != 0).all()
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=2e-5, rtol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_response_sees_only_its_prompt_and_itself(model):
    # Changing one response's tokens must not change another response's logprobs in the packed row.
    batch = _batch(_prompts([20]), group_size=4)
    lp, _ = _logprobs(model, batch, packed=True)
    other = TrainBatch(
        batch.tokens.clone(), batch.response_mask, batch.behaviour_logprobs, batch.policy_versions, batch.advantages
    )
    other.tokens[0][batch.response_mask[0]] = 7
    lp2, _ = _logprobs(model, other, packed=True)
    assert not torch.allclose(lp2[0], lp[0])
    torch.testing.assert_close(lp2[1:], lp[1:], atol=1e-6, rtol=0)


def test_packing_is_planned_only_when_it_saves_tokens():
    long_prompts = _batch(_prompts([40, 40]), group_size=8)
    p = plan_packing(long_prompts.tokens, long_prompts.response_mask)
    assert p is not None and p.num_tokens <= 0.5 * long_prompts.tokens.numel()
    assert p.tokens.shape[0] == 2  # one row per group
    singletons = _batch(_prompts([10, 12, 14]), group_size=1)  # SFT-like: no prompt shared
    assert plan_packing(singletons.tokens, singletons.response_mask) is None
    assert plan_packing(long_prompts.tokens, long_prompts.response_mask, max_len=32) is None


def _fixed_groups(prompt_len: int, response_len: int, groups: int, group_size: int) -> TrainBatch:
    episodes = [
        Episode(
            Completion(
                torch.tensor(_prompts([prompt_len])[0]) + g,
                torch.full((response_len,), 9),
                torch.zeros(response_len),
                torch.zeros(response_len, dtype=torch.long),
                "length",
            ),
            advantage=1.0,
        )
        for g in range(groups)
        for _ in range(group_size)
    ]
    return TrainBatch.collate(episodes, pad_id=0)


def test_packing_weighs_attentions_pairs_against_the_tokens_saved():
    """4 groups of 8, a 21-token prompt and 64-token responses (the 83M benchmark's batch): packed, 533-token rows
    hold 0.78 of the tokens. Counting tokens only, that saves 22%; with the 83M shape's attention counted they
    cost 0.86 of the unpacked forward and are packed by default; with attention 20 times as dear per pair, the
    long packed rows cost more than the short ones they replace and are not."""
    from forge_rl.models.qwen3_config import attention_pair_cost

    batch = _fixed_groups(21, 64, groups=4, group_size=8)
    shape_83m = dict(
        hidden_size=768, intermediate_size=2304, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12
    )
    a = attention_pair_cost(shape_83m)
    assert a == 2 * 768 / (4 * 768**2 + 3 * 768 * 2304)  # a pair costs 1/4,992 of a token
    packed = plan_packing(batch.tokens, batch.response_mask, pair_cost=a)
    assert packed is not None and packed.tokens.shape == (4, 21 + 8 * 64)
    assert plan_packing(batch.tokens, batch.response_mask, max_fraction=0.75) is None  # 0.78 of the tokens
    assert plan_packing(batch.tokens, batch.response_mask, pair_cost=20 * a) is None


def test_a_mixture_of_experts_pays_for_its_routed_experts_only():
    from forge_rl.models.qwen3_config import attention_pair_cost

    dense = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    moe = dict(dense, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)  # 2 x 128: the dense MLP's
    assert attention_pair_cost(moe) == pytest.approx(attention_pair_cost(dense))
    assert attention_pair_cost(dict(moe, num_experts_per_tok=4)) < attention_pair_cost(dense)


def test_a_row_without_response_tokens_is_named():
    tokens = torch.ones(2, 6, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    with pytest.raises(ValueError, match="row 1 has no response tokens"):
        plan_packing(tokens, mask)


@pytest.mark.parametrize("key, value", [("pack_max_fraction", 0.0), ("pack_max_fraction", 1.5), ("pack_max_len", 0)])
def test_bad_packing_settings_name_the_key(key, value):
    from forge_rl.actors.trainer_config import TrainerConfig

    with pytest.raises(ValueError, match=f"trainer.{key}"):
        TrainerConfig(**{key: value})
