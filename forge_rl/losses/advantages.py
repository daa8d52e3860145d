"""Group-relative advantages (GRPO): each episode's reward against its own group's."""

import torch


def group_advantages(rewards: list[float], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """(r - mean(group)) / (std(group) + eps); `scale_by_std=False` gives Dr. GRPO's unscaled form.
    A group whose rewards are all equal gets all-zero advantages (it carries no signal)."""
    if not rewards:
        raise ValueError("group_advantages: empty group")
    r = torch.tensor(rewards, dtype=torch.float64)
    centered = r - r.mean()
    if scale_by_std and len(rewards) > 1:
        centered = centered / (r.std() + eps)
    return centered.tolist()
