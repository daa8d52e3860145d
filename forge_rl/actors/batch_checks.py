"""What a TrainBatch must be before the trainer touches it: the whole-tensor checks of `validate_batches`, each
refusal one line naming the rank's batch, the field, what was expected and what came."""

import torch

from forge_rl.losses.logprobs import kept_refusal
from forge_rl.types import BatchShape, TrainBatch


def validate_batches(
    batches: list[TrainBatch | BatchShape],
    dp_size: int,
    vocab_size: int,
    max_len: int,
    own: int | None = None,
    routing: tuple[int, int, int] | None = None,
) -> None:
    """Reject a malformed input before anything changes (no forward, no optimizer step, no step count).
    Whole-tensor checks only, no per-token Python loops. The message names the rank's batch, the field,
    what was expected and what came. Entries other than this rank's (`own`) may be BatchShapes (their counts
    only: the run sends each rank its own batch); the trainer then agrees over ranks (`TrainModel.validate_everywhere`).
    `routing` (Keep Routing: MoE layers, top-k, experts): every batch must carry routes of that model."""
    if not isinstance(batches, (list, tuple)) or len(batches) != dp_size:
        got = len(batches) if isinstance(batches, (list, tuple)) else type(batches).__name__
        raise ValueError(f"Trainer.step takes one TrainBatch per data-parallel rank ({dp_size}), got {got}")
    for r, b in enumerate(batches):
        at = f"batch[{r}]"
        if isinstance(b, BatchShape) and r != own:
            if b.num_sequences < 1 or b.num_response_tokens < 1:
                raise ValueError(f"{at} is empty ({b}): every data-parallel rank needs rows with response tokens")
            continue
        if not isinstance(b, TrainBatch):
            raise ValueError(f"{at} is a {type(b).__name__}, expected a TrainBatch")
        _check_batch(at, b, vocab_size, max_len, routing)


def _check_batch(at: str, b: TrainBatch, vocab_size: int, max_len: int, routing: tuple[int, int, int] | None) -> None:
    """One rank's TrainBatch: its tensors' dtypes and shapes, then what their values must be."""
    _check_tensor(f"{at}.tokens", b.tokens, torch.int64)
    if b.tokens.dim() != 2:
        raise ValueError(f"{at}.tokens has shape {tuple(b.tokens.shape)}, expected 2 dims [B, T]")
    B, T = b.tokens.shape
    if B == 0 or T == 0:  # a rank without rows would skip the forward its FSDP peers wait in
        raise ValueError(f"{at} is empty: tokens has shape {(B, T)}, expected at least one sequence")
    if T > max_len:
        raise ValueError(f"{at}.tokens has sequences of {T} tokens; the model's max_seq_len is {max_len}")
    # The dtypes TrainBatch.collate makes: others would fail deep in the step (float ids, a uint8
    # mask) or silently change the loss's precision (float64 or bfloat16 logprobs).
    like_tokens = f" (tokens is {(B, T)})"
    _check_tensor(f"{at}.response_mask", b.response_mask, torch.bool, (B, T), like_tokens)
    _check_tensor(f"{at}.behaviour_logprobs", b.behaviour_logprobs, torch.float32, (B, T), like_tokens)
    _check_tensor(f"{at}.policy_versions", b.policy_versions, torch.int64, (B, T), like_tokens)
    per_token = isinstance(b.advantages, torch.Tensor) and tuple(b.advantages.shape) == (B, T)  # PPO's
    _check_tensor(
        f"{at}.advantages",
        b.advantages,
        torch.float32,
        (B, T) if per_token else (B,),
        f" (one per sequence) or {(B, T)} (one per token)",
    )
    for name in ("values", "returns", "ref_logprobs"):  # the critic's (PPO), the reference's
        if getattr(b, name) is not None:
            _check_tensor(f"{at}.{name}", getattr(b, name), torch.float32, (B, T), like_tokens)
    if b.kept is not None and (why := kept_refusal(b.kept, b.tokens, b.response_mask, vocab_size)):
        raise ValueError(f"{at}.kept {why}")
    if routing is not None:
        _check_routes(at, b.routes, (B, T), *routing)
    _check_values(at, b, vocab_size)


def _check_values(at: str, b: TrainBatch, vocab_size: int) -> None:
    """Token ids in the vocabulary, some response tokens after a prompt, and finite floats everywhere."""
    outside = (b.tokens < 0) | (b.tokens >= vocab_size)  # pad ids too: the model embeds every token
    if outside.any():
        where = tuple(outside.nonzero()[0].tolist())
        raise ValueError(
            f"{at}.tokens has id {int(b.tokens[where])} at {list(where)} "
            f"({int(outside.sum())} such ids), outside the model's vocabulary [0, {vocab_size})"
        )
    if b.num_response_tokens == 0:
        raise ValueError(f"{at} has no response tokens (response_mask is all False)")
    if b.response_mask[:, 0].any():
        raise ValueError(f"{at}.response_mask marks token 0; a response needs at least one prompt token")
    # The whole tensors, not just the response tokens: the loss masks by multiplying, and NaN * 0 is NaN.
    for name in ("advantages", "behaviour_logprobs", "ref_logprobs", "values", "returns"):
        value = getattr(b, name)
        if value is not None and not (finite := torch.isfinite(value)).all():
            where = tuple((~finite).nonzero()[0].tolist())
            raise ValueError(
                f"{at}.{name} has {value[where].item()} at {list(where)} "
                f"({int((~finite).sum())} non-finite values), expected finite values"
            )


def _check_routes(at: str, routes, tokens_shape: tuple[int, int], layers: int, top_k: int, experts: int) -> None:
    if routes is None:
        raise ValueError(
            f"{at} has no routes (TrainBatch.routes) and trainer.keep_routing is on: its completions "
            "came from a generator that does not record the engine's experts (generator record_routes)"
        )
    _check_tensor(f"{at}.routes", routes, torch.int16, (*tokens_shape, layers, top_k), " (tokens x MoE layers x top-k)")
    if ((routes < -1) | (routes >= experts)).any():
        raise ValueError(f"{at}.routes has expert ids outside [0, {experts}) (-1: no record)")


def _check_tensor(field: str, value, dtype: torch.dtype, shape: tuple[int, ...] | None = None, why: str = "") -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{field} is a {type(value).__name__}, expected a {dtype} tensor")
    if value.dtype != dtype:
        raise ValueError(f"{field} has dtype {value.dtype}, expected {dtype}")
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"{field} has shape {tuple(value.shape)}, expected {shape}{why}")
