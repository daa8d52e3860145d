"""Loss-parallel logprobs: two gloo ranks, each holding half of the vocabulary's logits, give the same
logprobs, entropy and logits gradient as one process with the whole logits (uneven shards, temperature,
entropy with its gradient, several blocks), with and without kept sets (truncated sampling: each rank masks its own
columns, and some positions' sets lie wholly in one shard)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from forge_rl.losses.logprobs import VocabShard, selected_logprobs, token_logprobs

V, B, T, TEMPERATURE = 13, 3, 6, 0.7  # 13 = 7 + 6: the shards are uneven


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64).float() * 3
    tokens = torch.randint(0, V, (B, T), generator=g)
    weights = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)  # a loss of both outputs
    return logits, tokens, weights


def _kept(tokens):
    """Sets of 1-4 ids holding each token: the token and the ids after it (mod V), so sets fall in one shard, in
    the other, or across both; row 2 keeps the whole vocabulary (-1 only)."""
    kept = torch.full((B, T, 4), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            size = 1 + (b + t) % 4
            kept[b, t, :size] = (tokens[b, t] + torch.arange(size) * 2) % V
    kept[2] = -1
    return kept


def _losses(fn, logits, tokens, weights, **kw):
    lp, ent = fn(logits, tokens, TEMPERATURE, entropy="grad", block_elements=2 * V, **kw)  # several blocks
    return lp, ent, (lp * weights[0]).sum() + (ent * weights[1]).sum()


def _rank(rank: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    logits, tokens, weights = _inputs()
    shard = VocabShard.of(dist.group.WORLD, V)
    mine = logits[..., shard.start : shard.start + (7 if rank == 0 else 6)].clone().requires_grad_()
    lp, ent, loss = _losses(token_logprobs, mine, tokens, weights, shard=shard)
    loss.backward()
    flat = mine.detach().flatten(0, 1)[:, None].squeeze(1)
    slp, sent = selected_logprobs(flat, tokens.flatten(), TEMPERATURE, entropy="detached", shard=shard)
    masked = mine.detach().clone().requires_grad_()
    klp, kent, kloss = _losses(token_logprobs, masked, tokens, weights, shard=shard, kept=_kept(tokens))
    kloss.backward()
    results[rank] = (lp.detach(), ent.detach(), mine.grad, slp, sent, klp.detach(), kent.detach(), masked.grad)
    dist.destroy_process_group()


def test_vocab_sharded_logprobs_match_whole_logits():
    logits, tokens, weights = _inputs()
    full = logits.clone().requires_grad_()
    lp, ent, loss = _losses(token_logprobs, full, tokens, weights)
    loss.backward()
    slp, sent = selected_logprobs(logits.flatten(0, 1), tokens.flatten(), TEMPERATURE, entropy="detached")
    with tempfile.TemporaryDirectory() as d, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(os.path.join(d, "init"), results), nprocs=2, start_method="spawn")
        results = dict(results)
    grads = torch.cat([results[0][2], results[1][2]], dim=-1)
    kept = logits.clone().requires_grad_()
    klp, kent, kloss = _losses(token_logprobs, kept, tokens, weights, kept=_kept(tokens))
    kloss.backward()
    for rank in (0, 1):
        r_lp, r_ent, _, r_slp, r_sent, r_klp, r_kent, _ = results[rank]
        torch.testing.assert_close(r_klp, klp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(r_kent, kent.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(r_lp, lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(r_ent, ent.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(r_slp, slp, atol=1e-5, rtol=0)
        torch.testing.assert_close(r_sent, sent, atol=1e-5, rtol=0)
    torch.testing.assert_close(grads, full.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([results[0][7], results[1][7]], dim=-1), kept.grad, atol=1e-5, rtol=0)
    assert (klp.detach() - lp.detach())[:2, 1:].min() > 0  # renormalised over sets smaller than the vocabulary


def test_sharded_logprobs_reject_token_ids_outside_the_vocabulary():
    class OneRank:  # VocabShard only needs the group for collectives, which bad input never reaches
        pass

    shard = VocabShard(OneRank(), 0, V)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 13\), got \[0, 13\]"):
        token_logprobs(torch.zeros(1, 2, V), torch.tensor([[0, V]]), shard=shard)
