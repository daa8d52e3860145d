"""PPO's critic side as small pure functions of [B, T] tensors aligned with `TrainBatch.tokens`.

`mask` is the response mask: the tokens the model sampled (an environment's tokens inside a multi-turn response
are not actions, so they are skipped: the step after a model token is the next *model* token). The value of
token t, V[b, t], is the critic's estimate of the return from the state just before the model chose token t.

- `terminal_rewards`: each sequence's reward on its last model token, 0 elsewhere (the trajectory's reward;
  PPO needs no group: one sample per prompt works).
- `gae`: generalised advantage estimation over the model tokens, delta_t = r_t + gamma V_{t+1} - V_t and
  A_t = sum_k (gamma lambda)^k delta_{t+k}, with V = 0 after the last model token; returns R_t = A_t + V_t are
  the critic's targets.
- `whiten`: (A - mean) / std over every model token of the step (all its data-parallel batches).
- `value_loss`: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per token (PPO's clipped value loss;
  `value_clip` 0 turns the clip off).
"""

import torch


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: `rewards` [B] on each row's last model token (the last True of `mask`), 0 elsewhere."""
    if not mask.any(-1).all():
        raise ValueError("terminal_rewards: a sequence has no model tokens (its response mask is all False)")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(-1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[torch.arange(mask.shape[0], device=mask.device), last] = rewards.to(torch.float32)
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and 0 outside `mask`. `rewards` and `values` [B, T] are read at the
    model tokens only; the value after a sequence's last model token is 0 (the episode ends there)."""
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(
            f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must have one shape [B, T]"
        )
    rewards, values = rewards.to(torch.float32), values.to(torch.float32)
    B, T = mask.shape
    advantages = torch.zeros(B, T, dtype=torch.float32, device=values.device)
    next_value = torch.zeros(B, dtype=torch.float32, device=values.device)
    running = torch.zeros(B, dtype=torch.float32, device=values.device)
    for t in reversed(range(T)):  # one column at a time, every row at once: T steps, not B x T
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * running
        advantages[:, t] = torch.where(m, here, 0.0)
        running = torch.where(m, here, running)  # an environment's token passes the running sums through
        next_value = torch.where(m, values[:, t], next_value)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def whiten(advantages: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """Each [B, T] of `advantages` minus the mean over every masked token of all of them, divided by their std;
    0 outside the masks. One set of statistics for the whole step, whatever rank a batch goes to."""
    picked = torch.cat([a[m] for a, m in zip(advantages, masks)])
    if picked.numel() == 0:
        raise ValueError("whiten: no model tokens")
    mean = picked.mean()
    std = picked.std(unbiased=False) if picked.numel() > 1 else torch.tensor(1.0)
    return [torch.where(m, (a - mean) / (std + eps), 0.0) for a, m in zip(advantages, masks)]


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss [B, T] and where the clipped term was the larger one (bool [B, T]); mask and
    reduce it like the policy loss. With value_clip 0 it is 0.5 (V - R)^2."""
    unclipped = (values - returns) ** 2
    if not value_clip:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 is a perfect critic, 0 one that predicts the mean, below
    0 one worse than that. NaN when the returns do not vary."""
    v, r = values[mask].double(), returns[mask].double()
    var = r.var(unbiased=False)
    return float(1 - (r - v).var(unbiased=False) / var) if var > 0 else float("nan")
