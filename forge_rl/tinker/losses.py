"""The Tinker API's built-in losses, on the trainer's per-token logprobs of each datum's target tokens. Each is a
sum over tokens (not a mean), as the client's recipes expect: a batch's loss is the sum of its datums' losses, and
a caller that wants a mean puts it in the weights or the advantages.

    cross_entropy        -sum(weights * logprobs)                      inputs: target_tokens, weights
    importance_sampling  -sum(exp(logprobs - sampling) * advantages)   inputs: target_tokens, logprobs, advantages
    ppo                  -sum(min(r * A, clip(r, low, high) * A))       the same inputs; config: clip_low_threshold,
                                                                       clip_high_threshold (0.8, 1.2 by default)

The custom-loss path of the client (forward_backward_custom) runs a forward pass, computes the loss on the
client, and sends its gradient with respect to the logprobs as cross_entropy's weights: served by the same code.
"""

import torch

from forge_rl.tinker.errors import Refused

INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}


def check_loss(loss_fn: str, config: dict) -> dict[str, float]:
    """The loss's settings, defaults filled; refuses a loss or a setting this service does not serve."""
    if loss_fn not in INPUTS:
        raise Refused(f"loss_fn={loss_fn!r} is not served; choose one of {', '.join(INPUTS)} (or a custom loss)")
    known = CONFIG.get(loss_fn, {})
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise Refused(
            f"loss_fn_config keys {unknown} are not settings of {loss_fn!r}; it takes {sorted(known) or 'none'}"
        )
    settings = {**known, **{k: float(v) for k, v in config.items()}}
    if loss_fn == "ppo" and not settings["clip_low_threshold"] <= 1 <= settings["clip_high_threshold"]:
        raise Refused(f"ppo needs clip_low_threshold <= 1 <= clip_high_threshold, got {settings}")
    return settings


def token_loss(loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], settings: dict) -> torch.Tensor:
    """The per-token loss [T] of one datum (its sum is the datum's loss)."""
    if loss_fn == "cross_entropy":
        return -inputs["weights"] * logprobs
    ratio = torch.exp(logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    clipped = ratio.clamp(settings["clip_low_threshold"], settings["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)
