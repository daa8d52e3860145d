"""Per-token logprobs (and entropy) from logits, a chunk of sequences at a time.

A full fp32 log-softmax over the vocabulary costs B x T x V x 4 bytes per copy, and the obvious code makes
several (the fp32 cast, the log-softmax, its exp, the product for the entropy, what autograd saves): at
Qwen3's 151,936-token vocabulary, 16 sequences x 2,048 tokens is ~20 GB per copy. Here each chunk of rows
is cast, reduced to the picked token's logprob (logit - logsumexp) and dropped; under autograd each chunk is
checkpointed, so backward recomputes its softmax instead of keeping it. Peak: the model's logits plus one
chunk's fp32 temporaries. The entropy is computed only when asked for: detached for logging, or with
gradient when an entropy bonus uses it.
"""

import torch
from torch.utils.checkpoint import checkpoint

ENTROPY = ("none", "detached", "grad")


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, entropy: str = "none",
    chunk_tokens: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob [B, T] of each token given its prefix under softmax(logits / temperature) (0 at t=0), and
    the entropy [B, T] of that distribution when `entropy` is "detached" or "grad" (else None)."""
    if entropy not in ENTROPY:
        raise ValueError(f"entropy={entropy!r}; choose one of {ENTROPY}")
    B, T, _ = logits.shape
    rows = max(1, chunk_tokens // max(T - 1, 1))
    grad = torch.is_grad_enabled() and logits.requires_grad
    picked, entropies = [], []
    for lo in range(0, B, rows):
        chunk, targets = logits[lo : lo + rows, :-1], tokens[lo : lo + rows, 1:]
        if grad:
            picked.append(checkpoint(_picked, chunk, targets, temperature, use_reentrant=False))
        else:
            picked.append(_picked(chunk, targets, temperature))
        if entropy == "grad" and grad:
            entropies.append(checkpoint(_entropy, chunk, temperature, use_reentrant=False))
        elif entropy != "none":
            with torch.no_grad():
                entropies.append(_entropy(chunk, temperature))
    pad = torch.zeros(B, 1, dtype=torch.float32, device=logits.device)
    logprobs = torch.cat([pad, torch.cat(picked)], 1)
    return logprobs, (torch.cat([pad, torch.cat(entropies)], 1) if entropies else None)


def _picked(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float() / temperature
    return x.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(x, -1)


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float() / temperature
    lse = torch.logsumexp(x, -1, keepdim=True)
    return (lse[..., 0] - (torch.softmax(x, -1) * x).sum(-1))
