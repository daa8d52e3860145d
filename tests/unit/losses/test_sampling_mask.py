"""Keep Sampling Mask, the trainer's side: logprobs, entropy and their gradients renormalised over each token's kept
set, blockwise (plain logits, the fused LM head, packed rows), against a hand computation; and the kept sets as
completions record them, through collate, the buffer and its checkpoint."""

import math

import pytest
import torch

from forge_rl.losses.fused_head import hidden_logprobs
from forge_rl.losses.logprobs import keep_only, selected_logprobs, token_logprobs

B, T, V, TEMPERATURE = 3, 7, 41, 0.7


def _kept(tokens: torch.Tensor, g: torch.Generator, k: int = 6) -> torch.Tensor:
    """[B, T, k] kept sets holding each token, -1 padded to various sizes; row 1 position 3 and all of position 0
    keep the whole vocabulary (no ids)."""
    kept = torch.full((*tokens.shape, k), -1, dtype=torch.int32)
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            size = 1 + (b + t) % k
            others = torch.randperm(V, generator=g)[:size]
            ids = torch.cat([tokens[b, t : t + 1], others[others != tokens[b, t]][: size - 1]])
            kept[b, t, : len(ids)] = ids.int()
    kept[1, 3] = -1
    kept[:, 0] = -1
    return kept


def _by_hand(logits, tokens, kept, temperature):
    """Per position: log p(token) and the entropy over the kept set, one position at a time in float64."""
    lp = torch.zeros(tokens.shape, dtype=torch.float64)
    ent = torch.zeros(tokens.shape, dtype=torch.float64)
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            x = logits[b, t - 1].double() / temperature
            ids = [int(i) for i in kept[b, t] if i >= 0] or list(range(V))
            lse = math.log(sum(math.exp(float(x[i])) for i in ids))
            lp[b, t] = float(x[int(tokens[b, t])]) - lse
            ent[b, t] = -sum(math.exp(float(x[i]) - lse) * (float(x[i]) - lse) for i in ids)
    return lp.float(), ent.float()


def _naive(logits, tokens, kept, temperature):
    """Masked log-softmax on the whole logits, with autograd's gradients."""
    x = keep_only(logits[:, :-1] / temperature, kept[:, 1:])
    logp = torch.log_softmax(x, -1)
    picked = logp.gather(-1, tokens[:, 1:, None])[..., 0]
    p = logp.exp()
    ent = -(p * logp.where(p > 0, 0.0)).sum(-1)
    pad = torch.zeros(tokens.shape[0], 1)
    return torch.cat([pad, picked], 1), torch.cat([pad, ent], 1)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return logits, tokens, _kept(tokens, g), torch.randn(B, T, generator=g)


def test_keep_only_masks_outside_the_set_and_a_shard_masks_its_own_columns():
    x = torch.zeros(2, 6)
    kept = torch.tensor([[4, 1, -1], [-1, -1, -1]], dtype=torch.int32)
    masked = keep_only(x, kept)
    assert masked[0].isfinite().tolist() == [False, True, False, False, True, False]
    assert masked[1].isfinite().all()  # no ids: the whole vocabulary
    shard = keep_only(x[:, :3], kept, start=3)  # columns are ids 3..5: only id 4 of row 0 is here
    assert shard[0].isfinite().tolist() == [False, True, False] and shard[1].isfinite().all()


@pytest.mark.parametrize("block_elements", [1, 3 * V, 10**7])
def test_masked_logprobs_and_entropy_equal_a_hand_computation_with_gradients(block_elements):
    logits, tokens, kept, weights = _inputs()
    want_lp, want_ent = _by_hand(logits, tokens, kept, TEMPERATURE)
    full_lp, _ = token_logprobs(logits, tokens, TEMPERATURE)
    leaf = logits.clone().requires_grad_()
    lp, ent = token_logprobs(leaf, tokens, TEMPERATURE, entropy="grad", block_elements=block_elements, kept=kept)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    # renormalised: above the full-vocabulary logprob where the set is a strict subset, equal where it is the whole
    restricted = (kept >= 0).any(-1)
    restricted[:, 0] = False
    assert (lp.detach() - full_lp)[restricted].min() > 0
    torch.testing.assert_close(lp.detach()[~restricted], full_lp[~restricted], atol=1e-6, rtol=0)
    assert (want_lp[(kept[..., 1] < 0) & restricted] == 0).all()  # a set of one token: log 1

    (grad,) = torch.autograd.grad((lp * weights).sum() + 0.1 * ent.sum(), leaf)
    naive_leaf = logits.clone().requires_grad_()
    nlp, nent = _naive(naive_leaf, tokens, kept, TEMPERATURE)
    (want_grad,) = torch.autograd.grad((nlp * weights).sum() + 0.1 * nent.sum(), naive_leaf)
    assert grad.isfinite().all()
    torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=0)
    outside = ~keep_only(torch.zeros(B, T, V), kept).isfinite()[:, 1:]
    assert (grad[:, :-1][outside] == 0).all()  # logits outside the set get no gradient


@pytest.mark.parametrize("memory_bytes", [1, 12 * 16 * V, 10**9])  # one position a block; a few, logits kept; one
@pytest.mark.parametrize("shift", [1, 0])
def test_fused_lm_head_and_packed_rows_apply_the_same_sets(shift, memory_bytes):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, 16, generator=g)
    weight = torch.randn(V, 16, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    kept, weights = _kept(tokens, g), torch.randn(B, T, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = hidden_logprobs(
        h, w, tokens, TEMPERATURE, entropy="grad", shift=shift, memory_bytes=memory_bytes, kept=kept
    )
    got = torch.autograd.grad((lp * weights).sum() + 0.1 * ent.sum(), (h, w))
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h2 @ w2.T
    if shift:
        want_lp, want_ent = token_logprobs(logits, tokens, TEMPERATURE, entropy="grad", kept=kept)
    else:  # packed rows: the logits already picked at the predicting positions, each with its target's set
        flat_lp, flat_ent = selected_logprobs(
            logits.flatten(0, 1), tokens.flatten(), TEMPERATURE, entropy="grad", kept=kept.flatten(0, 1)
        )
        want_lp, want_ent = flat_lp.view(B, T), flat_ent.view(B, T)
        # by hand: position t's logits predict tokens[t] (shift the tokens one on for _by_hand)
        by_hand, _ = _by_hand(
            torch.cat([logits.detach(), logits.detach()[:, -1:]], 1),
            torch.cat([tokens[:, :1], tokens], 1),
            torch.cat([kept[:, :1], kept], 1),
            TEMPERATURE,
        )
        torch.testing.assert_close(want_lp.detach(), by_hand[:, 1:], atol=1e-5, rtol=0)
    want = torch.autograd.grad((want_lp * weights).sum() + 0.1 * want_ent.sum(), (h2, w2))
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


# ---- the kept sets as recorded: generator outputs -> Completion -> buffer (and its checkpoint) -> TrainBatch ----


def _completion(prompt: list[int], response: list[int], sets: list[list[int]] | None, **kw):
    from forge_rl.types import Completion

    kept = {}
    if sets is not None:
        offsets = [0]
        for s in sets:
            offsets.append(offsets[-1] + len(s))
        kept = dict(
            kept_ids=torch.tensor([i for s in sets for i in s], dtype=torch.int32),
            kept_offsets=torch.tensor(offsets, dtype=torch.int32),
        )
    n = len(response)
    return Completion(
        torch.tensor(prompt),
        torch.tensor(response),
        -torch.rand(n),
        torch.zeros(n, dtype=torch.long),
        "stop",
        sampling={"temperature": 0.7, "top_p": 0.9},
        **kept,
        **kw,
    )


def test_the_generator_reads_kept_sets_from_processed_logprobs_and_marks_a_set_over_the_cap():
    """vLLM's processed logprobs hold -inf for every token outside the kept set: asked for cap + 1 of them, the
    finite ones are the set; cap + 1 finite ones mean a larger set, which is not recorded."""
    from vllm.logprobs import Logprob

    from forge_rl.actors.generator_outputs import Child

    def position(finite: list[int], minus_inf: list[int]) -> dict:
        return {**{t: Logprob(-1.0 - i) for i, t in enumerate(finite)}, **{t: Logprob(-math.inf) for t in minus_inf}}

    child = Child(cap=3)
    child.keep(position([5, 2], [7, 8]))
    child.keep(position([9], [1, 2, 3]))
    child.keep(position([4, 6, 1], [0]))  # exactly the cap
    assert (child.kept_ids, child.kept_offsets, child.over_cap) == ([5, 2, 9, 4, 6, 1], [0, 2, 3, 6], 0)
    child.keep(position([4, 6, 1, 3], []))  # cap + 1 finite: the set is larger than the cap
    assert child.over_cap == 1 and child.kept_offsets[-1] == child.kept_offsets[-2]


def test_completion_checks_its_csr_and_counts_its_bytes():
    c = _completion([1, 2], [3, 4, 5], [[3, 7], [4], [5, 6, 8]])
    assert c.kept_bytes == 4 * 6 + 4 * 4  # int32 ids and offsets
    with pytest.raises(ValueError, match="kept_offsets must hold 4 offsets"):
        _completion([1, 2], [3, 4, 5], [[3, 7], [4]])
    from forge_rl.types import Completion

    with pytest.raises(ValueError, match="come together"):
        Completion(
            torch.tensor([1]),
            torch.tensor([3]),
            torch.zeros(1),
            torch.zeros(1, dtype=torch.long),
            "stop",
            kept_ids=torch.tensor([3], dtype=torch.int32),
        )


def test_collate_pads_kept_sets_into_the_tokens_places_and_the_buffer_checkpoint_keeps_them(tmp_path):
    from forge_rl.actors.replay_buffer import GroupStore
    from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
    from forge_rl.actors.batch_checks import validate_batches
    from forge_rl.types import Episode, Group

    a = _completion([1, 2, 9], [3, 4], [[3, 7], [4]])
    b = _completion([1, 2, 9], [5, 6, 8], [[5], [6, 10, 11], [8, 12]])
    store = GroupStore(ReplayBufferConfig(), temperature=0.7)
    assert store.add(Group("p", [Episode(a, advantage=1.0), Episode(b, advantage=-1.0)]))
    torch.save(store.state_dict(), tmp_path / "state.pt")  # as save_checkpoint writes the buffer
    resumed = GroupStore(ReplayBufferConfig(), temperature=0.7)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    (batch,) = resumed.sample(policy_version=0, batch_groups=1)
    assert batch.kept.dtype == torch.int32 and tuple(batch.kept.shape) == (2, 6, 3)
    assert (batch.kept[:, :3] == -1).all()  # the prompt: the whole vocabulary
    assert batch.kept[0, 3].tolist() == [3, 7, -1] and batch.kept[0, 4].tolist() == [4, -1, -1]
    assert (batch.kept[0, 5] == -1).all()  # padding
    assert [batch.kept[1, t].tolist() for t in (3, 4, 5)] == [[5, -1, -1], [6, 10, 11], [8, 12, -1]]
    validate_batches([batch], 1, vocab_size=16, max_len=64)
    batch.kept[1, 4] = torch.tensor([10, 11, -1], dtype=torch.int32)  # the sampled 6 is no longer in its set
    with pytest.raises(ValueError, match=r"batch\[0\]\.kept does not hold the token at \[1, 4\] \(id 6\)"):
        validate_batches([batch], 1, vocab_size=16, max_len=64)
    batch.kept = batch.kept.long()
    with pytest.raises(ValueError, match=r"batch\[0\]\.kept is torch.int64 \(2, 6, 3\), expected int32"):
        validate_batches([batch], 1, vocab_size=16, max_len=64)


def test_a_multi_turn_trajectory_joins_its_turns_sets_with_none_for_the_environments_tokens():
    from forge_rl.loop.multiturn import KeptSets

    kept = KeptSets()
    kept.add_turn(_completion([1], [3, 4], [[3, 7], [4]]))
    kept.add_inserted(2)
    kept.add_turn(_completion([1], [5], [[5, 9, 6]]))
    fields = kept.fields()
    assert fields["kept_ids"].tolist() == [3, 7, 4, 5, 9, 6]
    assert fields["kept_offsets"].tolist() == [0, 2, 3, 3, 3, 6] and fields["kept_over_cap"] == 0
    unrecorded = KeptSets()
    unrecorded.add_turn(_completion([1], [3], None, kept_over_cap=1))
    assert unrecorded.fields() == {"kept_over_cap": 1}


def test_a_group_with_a_sample_over_the_cap_is_dropped_whole_and_counted_before_scoring():
    """The generator is scripted (one of three samples drew a token from more ids than the cap); the rollout's
    handling is what is tested: no reward is computed, the group never reaches the buffer, the count is in episodes
    and the first drop is printed with its reason."""
    import asyncio
    from types import SimpleNamespace

    from forge_rl.loop.rollout import DropLog, RolloutStats, rollout_group

    completions = [
        _completion([1, 2], [3, 4], [[3], [4, 5]]),
        _completion([1, 2], [3], None, kept_over_cap=1),
        _completion([1, 2], [6], [[6, 7]]),
    ]

    async def generate(prompt, n):
        return completions

    async def score(cs):
        raise AssertionError("a group that cannot be trained on is not scored")

    printed = []
    stats = RolloutStats(drop_log=DropLog(write=printed.append))
    group = asyncio.run(
        rollout_group(
            prompt_id="p7",
            prompt="1+1=",
            generator=SimpleNamespace(generate=SimpleNamespace(route=generate)),
            score=score,
            group_size=3,
            stats=stats,
        )
    )
    assert group is None and stats.drops["sampling_mask_over_cap"] == 3 and stats.generated_tokens == 4
    assert printed and "dropped group p7 (sampling_mask_over_cap): 1 of its 3 samples" in printed[0]
