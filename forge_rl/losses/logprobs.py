"""Per-token logprobs (and entropy) from logits, a block of positions at a time.

A full fp32 log-softmax over the vocabulary costs B x T x V x 4 bytes per copy, and the obvious code makes
several (the fp32 cast, the log-softmax, its exp, the product for the entropy, what autograd saves for
backward): at Qwen3's 151,936-token vocabulary, 16 sequences x 2,048 tokens is ~20 GB per copy. Here one
autograd function walks the positions in blocks of about `block_elements` logits: forward keeps only the
picked logprob and the entropy per position; backward recomputes each block's softmax and writes that
block of the logits' gradient in place. Peak: the logits, their gradient, and one block's fp32
temporaries. The entropy is computed only when asked for: detached for logging, or with its gradient
when an entropy bonus uses it.

`hidden_logprobs` goes one step further and fuses the lm_head: from the final hidden states and the
lm_head weight it makes each block's logits, uses them and drops them, so neither the logits nor their
gradient exist whole (the trainer uses it when the lm_head is neither FSDP-sharded nor TP-sharded).

Under tensor parallelism the lm_head's output is sharded over the vocabulary. `token_logprobs` and
`selected_logprobs` then take this rank's shard with a `VocabShard` (loss parallel): per block, one
all-reduce of the max and one of [sum of exp, picked logit, sum of p * logit] give the exact log-softmax
normaliser, the picked logprob and the entropy, so the full logits are never gathered. Backward needs
no collective: the gradient of a shard's logits depends only on that shard and the saved normaliser.
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
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, entropy: str = "none",
    block_elements: int = 1 << 24, shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob [B, T] of each token given its prefix under softmax(logits / temperature) (0 at t=0), and
    the entropy [B, T] of that distribution when `entropy` is "detached" or "grad" (else None). With
    `shard`, `logits` is this rank's vocabulary shard and the results are those of the whole vocabulary."""
    return _apply(logits, tokens, temperature, entropy, block_elements, shard, shift=1)


def selected_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, entropy: str = "none",
    block_elements: int = 1 << 24, shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob [M] of targets[m] under softmax(logits[m] / temperature), for logits [M, V] already picked
    at the predicting positions (shared-prompt packing), and the entropy [M] as in `token_logprobs`."""
    logprobs, ent = _apply(logits[None], targets[None], temperature, entropy, block_elements, shard, shift=0)
    return logprobs[0], (ent[0] if ent is not None else None)


def _apply(logits, tokens, temperature, entropy, block_elements, shard, shift):
    if entropy not in ENTROPY:
        raise ValueError(f"entropy={entropy!r}; choose one of {ENTROPY}")
    if shard is not None:
        logprobs, ent = _ShardedTokenLogprobs.apply(logits, tokens, float(temperature), entropy != "none",
                                                    block_elements, shift, shard)
    else:
        logprobs, ent = _TokenLogprobs.apply(logits, tokens, float(temperature), entropy != "none",
                                             block_elements, shift)
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


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, with_entropy, block_elements, shift):
        # logits[:, t] predict tokens[:, t + shift]; results are placed at t + shift
        B, T, V = logits.shape
        s = shift
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        ent = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        for b, lo, hi in _blocks(B, T, V, block_elements, shift):
            x = logits[b, lo:hi].float() / temperature
            logp = torch.log_softmax(x, -1)
            logprobs[b, lo + s : hi + s] = logp.gather(-1, tokens[b, lo + s : hi + s, None])[..., 0]
            if with_entropy:
                ent[b, lo + s : hi + s] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, tokens, ent)
        ctx.temperature, ctx.block_elements, ctx.shift = temperature, block_elements, shift
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_logprobs, grad_ent):
        logits, tokens, ent = ctx.saved_tensors
        B, T, V = logits.shape
        s = shift = ctx.shift
        grad = torch.zeros_like(logits)
        use_ent = grad_ent is not None and bool(grad_ent.any())
        for b, lo, hi in _blocks(B, T, V, ctx.block_elements, shift):
            out = (b, slice(lo + s, hi + s))
            g = _logits_grad(logits[b, lo:hi].float(), ctx.temperature, tokens[out], grad_logprobs[out],
                             ent[out] if use_ent else None, grad_ent[out] if use_ent else None)
            grad[b, lo:hi] = g.to(grad.dtype)
        return grad, None, None, None, None, None


def _logits_grad(x, temperature, targets, grad_logprobs, ent=None, grad_ent=None, lse=None, owned=None):
    """Gradient with respect to a block of logits x [..., V] of the picked logprobs (and entropy). For a
    vocabulary shard, `lse` is the whole vocabulary's log-normaliser and `owned` marks the targets in it
    (`targets` then being their local ids)."""
    x = x / temperature
    logp = torch.log_softmax(x, -1) if lse is None else x - lse[..., None]
    p = logp.exp()
    # d logprob(target) / dx = onehot(target) - p; d entropy / dx = -p * (log p + H)
    g = -p * grad_logprobs[..., None]
    g.scatter_add_(-1, targets[..., None], (grad_logprobs if owned is None else grad_logprobs * owned)[..., None])
    if grad_ent is not None:
        g -= p * (logp + ent[..., None]) * grad_ent[..., None]
    return g / temperature


class _ShardedTokenLogprobs(torch.autograd.Function):
    """`_TokenLogprobs` over one rank's vocabulary shard of the logits (loss parallel)."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, with_entropy, block_elements, shift, shard):
        B, T, V = logits.shape
        s = shift
        local, owned = _local_targets(tokens, shard, V)
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        ent = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        lse = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        # Blocks sized by the whole vocabulary: every rank must take the same steps (two collectives each).
        for b, lo, hi in _blocks(B, T, shard.vocab, block_elements, shift):
            out = (b, slice(lo + s, hi + s))
            x = logits[b, lo:hi].float() / temperature
            m = x.amax(-1)
            dist.all_reduce(m, dist.ReduceOp.MAX, group=shard.group)
            e = (x - m[..., None]).exp()
            picked = x.gather(-1, local[out][..., None])[..., 0] * owned[out]
            sums = torch.stack([e.sum(-1), picked, (e * x).sum(-1) if with_entropy else picked])
            dist.all_reduce(sums, group=shard.group)
            lse[out] = m + sums[0].log()
            logprobs[out] = sums[1] - lse[out]
            if with_entropy:  # H = lse - E_p[x]
                ent[out] = lse[out] - sums[2] / sums[0]
        ctx.save_for_backward(logits, local, owned, ent, lse)
        ctx.temperature, ctx.block_elements, ctx.shift = temperature, block_elements, shift
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_logprobs, grad_ent):
        # The loss, and so these upstream gradients, are the same on every rank of the group.
        logits, local, owned, ent, lse = ctx.saved_tensors
        B, T, V = logits.shape
        s = ctx.shift
        grad = torch.zeros_like(logits)
        use_ent = grad_ent is not None and bool(grad_ent.any())
        for b, lo, hi in _blocks(B, T, V, ctx.block_elements, s):
            out = (b, slice(lo + s, hi + s))
            g = _logits_grad(logits[b, lo:hi].float(), ctx.temperature, local[out], grad_logprobs[out],
                             ent[out] if use_ent else None, grad_ent[out] if use_ent else None,
                             lse=lse[out], owned=owned[out])
            grad[b, lo:hi] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None


def _local_targets(tokens: torch.Tensor, shard: VocabShard, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ids of the targets in this shard (0 where not in it) and a float mask of those that are."""
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= shard.vocab):
        raise ValueError(f"token ids must be in [0, {shard.vocab}), got [{int(tokens.min())}, {int(tokens.max())}]")
    local = tokens - shard.start
    inside = (local >= 0) & (local < local_vocab)
    return local.where(inside, 0), inside.float()


def hidden_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
    entropy: str = "none", shift: int = 1, block_elements: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` (shift 1) or `selected_logprobs` (shift 0) of logits = hidden [B, T, D] @ weight.T
    [V, D], with the lm_head fused in: each block's logits are made, used and dropped, in forward and again
    in backward, so neither the logits nor their gradient ever exist whole. The matmuls run in the compute
    dtype (`hidden`'s: bf16 under mixed precision, the step's largest matmul at a 151,936-wide vocabulary);
    the log-softmax, the logprobs, the entropy and the weight's gradient accumulate in fp32."""
    if entropy not in ENTROPY:
        raise ValueError(f"entropy={entropy!r}; choose one of {ENTROPY}")
    logprobs, ent = _HiddenLogprobs.apply(hidden, weight, tokens, float(temperature), entropy != "none",
                                          block_elements, shift)
    if entropy == "detached":
        ent = ent.detach()
    return logprobs, (ent if entropy != "none" else None)


class _HiddenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, with_entropy, block_elements, shift):
        B, T, _ = hidden.shape
        V, s = weight.shape[0], shift
        w = weight.to(hidden.dtype)  # the compute dtype
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
        for b, lo, hi in _blocks(B, T, V, block_elements, shift):
            logp = torch.log_softmax((hidden[b, lo:hi] @ w.T).float() / temperature, -1)
            logprobs[b, lo + s : hi + s] = logp.gather(-1, tokens[b, lo + s : hi + s, None])[..., 0]
            if with_entropy:
                ent[b, lo + s : hi + s] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, tokens, ent)
        ctx.temperature, ctx.block_elements, ctx.shift = temperature, block_elements, shift
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_logprobs, grad_ent):
        hidden, weight, tokens, ent = ctx.saved_tensors
        B, T, _ = hidden.shape
        V, s = weight.shape[0], ctx.shift
        w = weight.to(hidden.dtype)  # the compute dtype
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        use_ent = grad_ent is not None and bool(grad_ent.any())
        for b, lo, hi in _blocks(B, T, V, ctx.block_elements, s):
            out = (b, slice(lo + s, hi + s))
            h = hidden[b, lo:hi]
            g = _logits_grad((h @ w.T).float(), ctx.temperature, tokens[out], grad_logprobs[out],
                             ent[out] if use_ent else None, grad_ent[out] if use_ent else None).to(w.dtype)
            grad_hidden[b, lo:hi] = (g @ w).to(grad_hidden.dtype)
            grad_weight += (g.flatten(0, -2).T @ h.flatten(0, -2)).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None
