"""Per-token logprobs (and entropy) from logits, a block of positions at a time.

A full fp32 log-softmax over the vocabulary costs B x T x V x 4 bytes per copy, and the obvious code makes
several (the fp32 cast, the log-softmax, its exp, the product for the entropy, what autograd saves for
backward): at Qwen3's 151,936-token vocabulary, 16 sequences x 2,048 tokens is ~20 GB per copy. Here one
autograd function walks the positions in blocks of about `block_elements` logits: forward keeps only the
picked logprob and the entropy per position; backward recomputes each block's softmax and writes that
block of the logits' gradient in place. Peak: the logits, their gradient, and one block's fp32
temporaries. The entropy is computed only when asked for: detached for logging, or with its gradient
when an entropy bonus uses it.

The fused head (`forge_rl.losses.fused_head.hidden_logprobs`) goes one step further: from the final hidden states
and the lm_head weight it makes the logits a block at a time, so they need not exist whole (the trainer uses it when
the lm_head is neither FSDP-sharded nor TP-sharded).

Under tensor parallelism the lm_head's output is sharded over the vocabulary. `token_logprobs` and
`selected_logprobs` then take this rank's shard with a `VocabShard` (loss parallel): per block, one
all-reduce of the max and one of [sum of exp, picked logit, sum of p * logit] give the exact log-softmax
normaliser, the picked logprob and the entropy, so the full logits are never gathered. Backward needs
no collective: the gradient of a shard's logits depends only on that shard and the saved normaliser.

Truncated sampling (top_p, top_k, min_p) draws each token from a subset of the vocabulary, its kept set, and the
engine's behaviour logprob is renormalised over it. Every function here takes `kept` [B, T, K] (int, aligned with
the tokens, -1 padding; a position without ids keeps the whole vocabulary, docs/algorithms.md): each block's
logits outside the position's set become -inf after the temperature division, so the log-softmax, the entropy
and the gradient are over the set (a vocabulary shard masks its own columns; the fused head its block's logits).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

ENTROPY = ("none", "detached", "grad")


@dataclass(frozen=True)
class VocabShard:
    """This rank's logits hold the vocabulary ids from `start` on (as many as their last dimension) of a
    vocabulary of `vocab` ids split over the ranks of `group`."""

    group: dist.ProcessGroup
    start: int
    vocab: int

    @classmethod
    def of(cls, group: dist.ProcessGroup, vocab: int) -> "VocabShard":
        """This rank's shard when `vocab` is split into `group`-size chunks as torch.chunk (and DTensor's
        Shard) splits it: chunks of ceil(vocab / ranks), the last ones smaller."""
        chunk = -(-vocab // dist.get_world_size(group))
        return cls(group, min(vocab, chunk * dist.get_rank(group)), vocab)


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    entropy: str = "none",
    block_elements: int = 1 << 24,
    shard: VocabShard | None = None,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob [B, T] of each token given its prefix under softmax(logits / temperature) (0 at t=0), and
    the entropy [B, T] of that distribution when `entropy` is "detached" or "grad" (else None). With
    `shard`, `logits` is this rank's vocabulary shard and the results are those of the whole vocabulary.
    With `kept` [B, T, K], each token's distribution is renormalised over its kept set (the module doc)."""
    return _apply(logits, tokens, temperature, entropy, block_elements, shard, kept, shift=1)


def selected_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: str = "none",
    block_elements: int = 1 << 24,
    shard: VocabShard | None = None,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob [M] of targets[m] under softmax(logits[m] / temperature), for logits [M, V] already picked
    at the predicting positions (shared-prompt packing), and the entropy [M] as in `token_logprobs`; `kept`
    [M, K]: each target's kept set."""
    kept = kept[None] if kept is not None else None
    logprobs, ent = _apply(logits[None], targets[None], temperature, entropy, block_elements, shard, kept, shift=0)
    return logprobs[0], (ent[0] if ent is not None else None)


def _apply(logits, tokens, temperature, entropy, block_elements, shard, kept, shift):
    if entropy not in ENTROPY:
        raise ValueError(f"entropy={entropy!r}; choose one of {ENTROPY}")
    if shard is not None:
        logprobs, ent = _ShardedTokenLogprobs.apply(
            logits, tokens, float(temperature), entropy != "none", block_elements, shift, shard, kept
        )
    else:
        logprobs, ent = _TokenLogprobs.apply(
            logits, tokens, float(temperature), entropy != "none", block_elements, shift, kept
        )
    if entropy == "detached":
        ent = ent.detach()
    return logprobs, (ent if entropy != "none" else None)


def _blocks(B: int, T: int, V: int, block_elements: int, shift: int = 1):
    """(rows, start, end) spans over the predicting positions 0..T-1-shift, ~block_elements logits each:
    several whole rows at once when a row fits (few Python steps for small vocabularies), else pieces of
    one row."""
    end = T - shift
    per_row = max(end, 1) * V
    if per_row <= block_elements:
        rows = block_elements // per_row
        for b in range(0, B, rows):
            yield slice(b, min(b + rows, B)), 0, end
        return
    step = max(1, block_elements // V)
    for b in range(B):
        for t in range(0, end, step):
            yield slice(b, b + 1), t, min(t + step, end)


def keep_only(x: torch.Tensor, kept: torch.Tensor | None, start: int = 0) -> torch.Tensor:
    """`x` [..., V] with every column outside its position's kept set at -inf. `kept` [..., K]: vocabulary ids,
    -1 padding (a position with none keeps every column); `start`: the vocabulary id of x's column 0 (a shard's
    first), so a shard masks its own columns and ignores the ids of others."""
    if kept is None:
        return x
    return x.masked_fill(~allowed_columns(x.shape, kept, start, x.device), float("-inf"))


def allowed_columns(shape: torch.Size, kept: torch.Tensor, start: int = 0, device=None) -> torch.Tensor:
    """Bool [..., V] (`shape`): True for the columns in each position's kept set (`keep_only`)."""
    V = shape[-1]
    local = kept.long() - start
    inside = (kept >= 0) & (local >= 0) & (local < V)
    allow = torch.zeros(*shape[:-1], V + 1, dtype=torch.bool, device=device)
    allow.scatter_(-1, local.where(inside, V), True)  # ids outside this shard land in the extra column
    return allow[..., :V] | ~(kept >= 0).any(-1, keepdim=True)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dimension; columns with p = 0 (outside a kept set: log p = -inf) add 0."""
    p = logp.exp()
    return -(p * logp.where(p > 0, 0.0)).sum(-1)


def _kept_at(kept, b, lo, hi):
    return kept[b, lo:hi] if kept is not None else None


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, with_entropy, block_elements, shift, kept):
        # logits[:, t] predict tokens[:, t + shift]; results are placed at t + shift
        B, T, V = logits.shape
        s = shift
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        ent = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        for b, lo, hi in _blocks(B, T, V, block_elements, shift):
            x = keep_only(logits[b, lo:hi].float() / temperature, _kept_at(kept, b, lo + s, hi + s))
            logp = torch.log_softmax(x, -1)
            logprobs[b, lo + s : hi + s] = logp.gather(-1, tokens[b, lo + s : hi + s, None])[..., 0]
            if with_entropy:
                ent[b, lo + s : hi + s] = _entropy(logp)
        ctx.save_for_backward(logits, tokens, ent, kept)
        ctx.temperature, ctx.block_elements, ctx.shift = temperature, block_elements, shift
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_logprobs, grad_ent):
        logits, tokens, ent, kept = ctx.saved_tensors
        B, T, V = logits.shape
        s = shift = ctx.shift
        grad = torch.zeros_like(logits)
        use_ent = grad_ent is not None and bool(grad_ent.any())
        for b, lo, hi in _blocks(B, T, V, ctx.block_elements, shift):
            out = (b, slice(lo + s, hi + s))
            g = _logits_grad(
                logits[b, lo:hi].float(),
                ctx.temperature,
                tokens[out],
                grad_logprobs[out],
                ent[out] if use_ent else None,
                grad_ent[out] if use_ent else None,
                kept=_kept_at(kept, b, lo + s, hi + s),
            )
            grad[b, lo:hi] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None


def _logits_grad(
    x, temperature, targets, grad_logprobs, ent=None, grad_ent=None, lse=None, owned=None, kept=None, start=0
):
    """Gradient with respect to a block of logits x [..., V] of the picked logprobs (and entropy). For a
    vocabulary shard, `lse` is the whole vocabulary's log-normaliser and `owned` marks the targets in it
    (`targets` then being their local ids, `start` the shard's first id). `kept`: the kept sets (keep_only);
    the logits outside them get no gradient."""
    x = keep_only(x / temperature, kept, start)
    logp = torch.log_softmax(x, -1) if lse is None else x - lse[..., None]
    p = logp.exp()
    # d logprob(target) / dx = onehot(target) - p; d entropy / dx = -p * (log p + H)
    g = -p * grad_logprobs[..., None]
    g.scatter_add_(-1, targets[..., None], (grad_logprobs if owned is None else grad_logprobs * owned)[..., None])
    if grad_ent is not None:
        g -= p * (logp.where(p > 0, 0.0) + ent[..., None]) * grad_ent[..., None]
    return g / temperature


class _ShardedTokenLogprobs(torch.autograd.Function):
    """`_TokenLogprobs` over one rank's vocabulary shard of the logits (loss parallel)."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, with_entropy, block_elements, shift, shard, kept):
        B, T, V = logits.shape
        s = shift
        local, owned = _local_targets(tokens, shard, V)
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        ent = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        lse = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        # Blocks sized by the whole vocabulary: every rank must take the same steps (two collectives each).
        for b, lo, hi in _blocks(B, T, shard.vocab, block_elements, shift):
            out = (b, slice(lo + s, hi + s))
            x = keep_only(logits[b, lo:hi].float() / temperature, _kept_at(kept, b, lo + s, hi + s), shard.start)
            m = x.amax(-1)  # -inf where this shard holds none of a kept set: the other shards' max wins
            dist.all_reduce(m, dist.ReduceOp.MAX, group=shard.group)
            e = (x - m[..., None]).exp()
            picked = x.gather(-1, local[out][..., None])[..., 0].where(owned[out] > 0, 0.0)
            sums = torch.stack([e.sum(-1), picked, (e * x.where(e > 0, 0.0)).sum(-1) if with_entropy else picked])
            dist.all_reduce(sums, group=shard.group)
            lse[out] = m + sums[0].log()
            logprobs[out] = sums[1] - lse[out]
            if with_entropy:  # H = lse - E_p[x]
                ent[out] = lse[out] - sums[2] / sums[0]
        ctx.save_for_backward(logits, local, owned, ent, lse, kept)
        ctx.temperature, ctx.block_elements, ctx.shift, ctx.start = temperature, block_elements, shift, shard.start
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_logprobs, grad_ent):
        # The loss, and so these upstream gradients, are the same on every rank of the group.
        logits, local, owned, ent, lse, kept = ctx.saved_tensors
        B, T, V = logits.shape
        s = ctx.shift
        grad = torch.zeros_like(logits)
        use_ent = grad_ent is not None and bool(grad_ent.any())
        for b, lo, hi in _blocks(B, T, V, ctx.block_elements, s):
            out = (b, slice(lo + s, hi + s))
            g = _logits_grad(
                logits[b, lo:hi].float(),
                ctx.temperature,
                local[out],
                grad_logprobs[out],
                ent[out] if use_ent else None,
                grad_ent[out] if use_ent else None,
                lse=lse[out],
                owned=owned[out],
                kept=_kept_at(kept, b, lo + s, hi + s),
                start=ctx.start,
            )
            grad[b, lo:hi] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None, None


def _local_targets(tokens: torch.Tensor, shard: VocabShard, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ids of the targets in this shard (0 where not in it) and a float mask of those that are."""
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= shard.vocab):
        raise ValueError(f"token ids must be in [0, {shard.vocab}), got [{int(tokens.min())}, {int(tokens.max())}]")
    local = tokens - shard.start
    inside = (local >= 0) & (local < local_vocab)
    return local.where(inside, 0), inside.float()


def kept_refusal(kept, tokens: torch.Tensor, response_mask: torch.Tensor, vocab: int) -> str | None:
    """What is wrong with a TrainBatch's `kept` sets [B, T, K] for its `tokens` [B, T], or None: int32, ids in
    [-1, vocab), and every response token inside its own set (else its logprob would be -inf)."""
    B, T = tokens.shape
    if not isinstance(kept, torch.Tensor) or kept.dtype != torch.int32 or kept.dim() != 3 or kept.shape[:2] != (B, T):
        what = f"{kept.dtype} {tuple(kept.shape)}" if isinstance(kept, torch.Tensor) else type(kept).__name__
        return f"is {what}, expected int32 [{B}, {T}, K] (the kept set of each token, -1 padded)"
    if kept.numel() and (int(kept.min()) < -1 or int(kept.max()) >= vocab):
        return f"has ids in [{int(kept.min())}, {int(kept.max())}], outside [-1, {vocab}) (-1 pads)"
    restricted = (kept >= 0).any(-1)
    outside = restricted & response_mask & ~(kept == tokens[..., None].int()).any(-1)
    if outside.any():
        b, t = outside.nonzero()[0].tolist()
        return (
            f"does not hold the token at [{b}, {t}] (id {int(tokens[b, t])}) in its kept set "
            f"({int(outside.sum())} such tokens): a token is always drawn from its kept set"
        )
    return None
