"""Per-token logprobs (and entropy) straight from the final hidden states and the lm_head weight: the fused head.

    lp, ent = hidden_logprobs(hidden, lm_head.weight, tokens, temperature, entropy="detached")

At Qwen3's 151,936-token vocabulary the logits of one micro-batch are its largest tensor (8 x 2,048 tokens: 2.5e9
logits, 5 GB in bf16, 10 GB per fp32 copy) and the step's largest matmul. Here the logits are made a block of
positions at a time, within a memory budget (`memory_bytes`):

- When the whole micro-batch's logits fit in half the budget (in the compute dtype), they are kept from the forward
  for the backward, which then writes each block's gradient over them and runs the head's two backward matmuls once,
  over all positions. Nothing is computed twice.
- Otherwise each block's logits are made, used and dropped, in the forward and again in the backward (the matmul is
  recomputed: a third more of the head's FLOPs, the price of not holding the logits).

The matmuls run in the compute dtype (`compute_dtype`, by default `hidden`'s: bf16 under mixed precision, where
autocast leaves the final norm's output, and so `hidden`, in fp32); the log-softmax, the logprobs, the entropy and the
weight's gradient accumulate in fp32. Each block's elementwise work runs in place in two fp32 buffers:
the log-normaliser and the entropy come from one exp pass, and the backward needs only the saved log-normaliser.

On the CPU the buffers are kept between calls (`Workspace`): a new tensor of hundreds of MB costs its page faults
each time (the allocator hands large blocks back to the OS when they are freed), and on two cores those faults cost
more than the arithmetic. CUDA's caching allocator already reuses its blocks, so there a call allocates.

Truncated sampling (top_p, top_k, min_p): `kept` [B, T, K] holds each token's kept set (forge_rl.losses.logprobs);
the logits outside it are masked before the log-softmax, so the logprobs, the entropy and the gradient are over the
set.
"""

import threading
import weakref

import torch

from forge_rl.deps.pytorch import is_fake
from forge_rl.losses.logprobs import ENTROPY, allowed_columns

CPU_BUDGET_BYTES = 2 << 30
CUDA_BUDGET_BYTES = 1 << 30


def default_memory_bytes(device: torch.device) -> int:
    """The fused head's working memory when trainer.lm_head_memory_mb is 0 (auto). On a GPU it adds to the step's
    peak (the logits' block is made while the decoder's activations are held): 1 GiB blocks run the head's matmuls
    at full size while the activations of a Qwen3-0.6B micro-batch of 8 x 2,048 tokens are ~40 GB. On a CPU, 2 GiB
    keeps a micro-batch of ~1,300 positions of a 151,936-token vocabulary whole."""
    return CUDA_BUDGET_BYTES if device.type == "cuda" else CPU_BUDGET_BYTES


def hidden_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    entropy: str = "none",
    shift: int = 1,
    memory_bytes: int | None = None,
    kept: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob [B, T] of each token under softmax(hidden @ weight.T / temperature) (`token_logprobs` when shift is
    1: position t predicts token t+1, 0 at t=0; `selected_logprobs` when shift is 0: position t predicts token t),
    and the entropy [B, T] when `entropy` is "detached" or "grad". `memory_bytes`: the working memory (None: the
    device's default); `kept` [B, T, K]: the kept sets of truncated sampling; `compute_dtype`: the matmuls' dtype
    (None: hidden's)."""
    if entropy not in ENTROPY:
        raise ValueError(f"entropy={entropy!r}; choose one of {ENTROPY}")
    budget = memory_bytes if memory_bytes is not None else default_memory_bytes(hidden.device)
    logprobs, ent = _FusedHead.apply(
        hidden, weight, tokens, float(temperature), entropy != "none", int(budget), shift, kept, compute_dtype
    )
    if entropy == "detached":
        ent = ent.detach()
    return logprobs, (ent if entropy != "none" else None)


def plan_blocks(positions: int, vocab: int, budget: int, compute_bytes: int = 2) -> tuple[bool, int]:
    """(keep the logits for the backward, positions per block) for `positions` x `vocab` logits within `budget`
    bytes: a block takes two fp32 buffers per logit, plus its logits in the compute dtype when they are not kept."""
    kept_bytes = positions * vocab * compute_bytes
    keep = kept_bytes <= budget // 2
    per_position = vocab * (8 + (0 if keep else compute_bytes))
    rows = (budget - (kept_bytes if keep else 0)) // per_position
    return keep, int(min(max(rows, 1), max(positions, 1)))


class Workspace:
    """Buffers reused between calls on the CPU (see the module doc), per thread. `scratch` buffers live for one
    forward or backward; the kept logits live from a forward to its backward, so they are lent: a forward that finds
    them still lent (its backward has not run, or its graph is still alive) gets new ones."""

    _local = threading.local()

    @classmethod
    def scratch(cls, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(rows, cols, dtype=dtype, device=device)
        buffers = cls._buffers()
        buf = buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < rows * cols:
            buffers[name] = buf = None  # free the old one before making the larger
            buf = torch.empty(rows * cols, dtype=dtype)
            if is_fake(buf):  # made under a fake-tensor mode (the rehearsal): never handed to real code later
                return buf.view(rows, cols)
            buffers[name] = buf
        return buf[: rows * cols].view(rows, cols)

    @classmethod
    def lend(cls, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, object]:
        """(buffer, lease): the buffer is lent while `lease` is alive (the caller keeps it with its graph)."""
        lease = _Lease()
        if device.type != "cpu":
            return torch.empty(rows, cols, dtype=dtype, device=device), lease
        lent = getattr(cls._local, "lease", None)
        if lent is not None and lent() is not None:  # still in use: a second forward before the first's backward
            return torch.empty(rows, cols, dtype=dtype), lease
        buf = cls.scratch("kept_logits", rows, cols, dtype, device)
        if not is_fake(buf):
            cls._local.lease = weakref.ref(lease)
        return buf, lease

    @classmethod
    def release(cls) -> None:
        """Give this thread's buffers back to the allocator (and so, on the CPU, to the OS)."""
        cls._local.buffers = {}
        cls._local.lease = None

    @classmethod
    def _buffers(cls) -> dict:
        if not hasattr(cls._local, "buffers"):
            cls._local.buffers = {}
        return cls._local.buffers


class _Lease:
    """Alive while a forward's kept logits wait for its backward."""


def _flat(hidden, tokens, kept, shift, dtype):
    """The predicting positions as rows: hidden [M, D] in `dtype`, their targets [M] and kept sets [M, K]."""
    B, T, D = hidden.shape
    n = T - shift
    h = hidden[:, :n].reshape(B * n, D).to(dtype)
    targets = tokens[:, shift:].reshape(B * n)
    return h, targets, (kept[:, shift:].reshape(B * n, kept.shape[-1]) if kept is not None else None)


def _unflat(values: torch.Tensor, B: int, T: int, shift: int) -> torch.Tensor:
    out = torch.zeros(B, T, dtype=values.dtype, device=values.device)
    out[:, shift:] = values.view(B, T - shift)
    return out


def _scaled_logits(z: torch.Tensor, logits: torch.Tensor, temperature: float, kept: torch.Tensor | None) -> None:
    """z (fp32) = logits / temperature, outside the kept sets the lowest finite float: exp gives 0 there, and
    0 x z stays 0 in the entropy's sum (where -inf would give NaN)."""
    z.copy_(logits)
    if temperature != 1.0:
        z.div_(temperature)
    if kept is not None:
        z.masked_fill_(~allowed_columns(z.shape, kept, device=z.device), torch.finfo(z.dtype).min)


def _compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The lm_head weight in the compute dtype: itself, or a copy made once per call in a workspace buffer (autocast
    would make one per use)."""
    if weight.dtype == dtype:
        return weight
    w = Workspace.scratch("weight", weight.shape[0], weight.shape[1], dtype, weight.device)
    return w.copy_(weight)


class _FusedHead(torch.autograd.Function):
    @staticmethod
    @torch.autocast("cuda", enabled=False)
    @torch.autocast("cpu", enabled=False)
    def forward(ctx, hidden, weight, tokens, temperature, with_entropy, budget, shift, kept, compute_dtype):
        B, T, _ = hidden.shape
        V, dev, cd = weight.shape[0], hidden.device, compute_dtype or hidden.dtype
        h, targets, kept_flat = _flat(hidden, tokens, kept, shift, cd)
        M = h.shape[0]
        keep, rows = plan_blocks(M, V, budget, h.element_size())
        keep = keep and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])  # no backward: nothing to keep
        ctx.set_materialize_grads(False)  # an unused entropy gets no gradient (None), not zeros to test
        w = _compute_weight(weight, cd)
        logits, lease = Workspace.lend(M, V, cd, dev) if keep else (None, None)
        lp = torch.zeros(M, dtype=torch.float32, device=dev)
        ent = torch.zeros(M, dtype=torch.float32, device=dev)
        lse = torch.zeros(M, dtype=torch.float32, device=dev)
        for lo in range(0, M, rows):
            hi = min(lo + rows, M)
            x = logits[lo:hi] if keep else Workspace.scratch("logits", hi - lo, V, cd, dev)
            torch.mm(h[lo:hi], w.t(), out=x)
            z = Workspace.scratch("z", hi - lo, V, torch.float32, dev)
            e = Workspace.scratch("e", hi - lo, V, torch.float32, dev)
            _scaled_logits(z, x, temperature, kept_flat[lo:hi] if kept_flat is not None else None)
            top = z.amax(-1, keepdim=True)
            z.sub_(top)
            torch.exp(z, out=e)
            sums = e.sum(-1)
            log_sums = sums.log()
            lse[lo:hi] = top[:, 0] + log_sums
            lp[lo:hi] = z.gather(-1, targets[lo:hi, None])[:, 0] - log_sums
            if with_entropy:  # H = log s - sum(e z) / s, with e = exp(z) and s = sum(e) (z shifted by its max)
                ent[lo:hi] = log_sums - torch.bmm(e[:, None, :], z[:, :, None])[:, 0, 0] / sums
        ctx.save_for_backward(hidden, weight, tokens, ent, lse, kept, logits if keep else None)
        ctx.lease = lease
        ctx.compute_weight, ctx.compute_weight_version = w, w._version  # reused by the backward if still this copy
        ctx.temperature, ctx.shift, ctx.rows, ctx.compute_dtype = temperature, shift, rows, cd
        return _unflat(lp, B, T, shift), _unflat(ent, B, T, shift)

    @staticmethod
    @torch.autocast("cuda", enabled=False)
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, grad_logprobs, grad_ent):
        hidden, weight, tokens, ent, lse, kept, logits = ctx.saved_tensors
        B, T, D = hidden.shape
        V, dev, s, rows, cd = weight.shape[0], hidden.device, ctx.shift, ctx.rows, ctx.compute_dtype
        h, targets, kept_flat = _flat(hidden, tokens, kept, s, cd)
        M = h.shape[0]
        grad_lp = (
            grad_logprobs[:, s:].reshape(M).float()
            if grad_logprobs is not None
            else torch.zeros(M, dtype=torch.float32, device=dev)
        )
        use_ent = grad_ent is not None
        grad_h = torch.empty(M, D, dtype=cd, device=dev)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if M == 0 else None
        w = ctx.compute_weight  # the forward's copy, unless another call has written its buffer since
        if w._version != ctx.compute_weight_version:
            w = _compute_weight(weight, cd)
        for lo in range(0, M, rows):
            hi = min(lo + rows, M)
            if logits is not None:
                x = logits[lo:hi]
            else:
                x = Workspace.scratch("logits", hi - lo, V, cd, dev)
                torch.mm(h[lo:hi], w.t(), out=x)
            g = _block_grad(
                x,
                ctx.temperature,
                targets[lo:hi],
                grad_lp[lo:hi],
                lse[lo:hi],
                ent[lo:hi] if use_ent else None,
                grad_ent[:, s:].reshape(M)[lo:hi].float() if use_ent else None,
                kept_flat[lo:hi] if kept_flat is not None else None,
            )
            x.copy_(g)  # the logits' gradient, in the compute dtype, over the logits
            if logits is None:  # recomputed blocks: their share of both matmuls now
                torch.mm(x, w, out=grad_h[lo:hi])
                block_w = torch.mm(x.t(), h[lo:hi])
                grad_w = block_w.float() if grad_w is None else grad_w.add_(block_w)
        if logits is not None:  # every block's gradient is in `logits`: each matmul once, over all positions
            torch.mm(logits, w, out=grad_h)
            grad_w = torch.mm(logits.t(), h)
        ctx.lease = None  # the kept logits may be lent again
        grad_hidden = torch.zeros_like(hidden)
        grad_hidden[:, : T - s] = grad_h.view(B, T - s, D)  # in hidden's dtype
        return grad_hidden, grad_w.to(weight.dtype), None, None, None, None, None, None, None


def _block_grad(x, temperature, targets, grad_lp, lse, ent=None, grad_ent=None, kept=None) -> torch.Tensor:
    """d(sum grad_lp * logprob + sum grad_ent * entropy) / d logits for one block of logits x [n, V], in a workspace
    fp32 buffer: d logprob(target) / dz = onehot(target) - p and d entropy / dz = -p (log p + H), with z = x / T."""
    z = Workspace.scratch("z", x.shape[0], x.shape[1], torch.float32, x.device)
    p = Workspace.scratch("e", x.shape[0], x.shape[1], torch.float32, x.device)
    _scaled_logits(z, x, temperature, kept)
    z.sub_(lse[:, None])  # log p
    torch.exp(z, out=p)
    if grad_ent is not None:  # coefficient of -p: grad_lp + (log p + H) grad_ent, built in z
        z.add_(ent[:, None]).mul_(grad_ent[:, None]).add_(grad_lp[:, None])
        p.mul_(z).neg_()
    else:
        p.mul_(-grad_lp[:, None])
    p.scatter_add_(-1, targets[:, None], grad_lp[:, None])
    if temperature != 1.0:
        p.div_(temperature)
    return p
