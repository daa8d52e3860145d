"""The data that flows between actors: Completion -> Episode -> Group -> TrainBatch.

Plain dataclasses of 1-D tensors and scalars. They cross Monarch with their tensors as numpy arrays
(`_NumpyOnTheWire`): Monarch pickles a tensor with a whole `torch.save` of its storage, which costs far
more than the data for the small tensors here, and sends the whole storage of a view. This module
imports nothing of forge_rl.

Token alignment used everywhere: a sequence is `prompt_ids + response_ids`; the behaviour logprob
and policy version of response token i belong to that token (the logprob of choosing it). In a multi-turn
response, `env_mask` marks the tokens the environment inserted between the model's turns: they are context,
not actions, so the loss never sees them (their logprob is 0 and their version the model token's before them).

Truncated sampling (top_p, top_k, min_p) draws each token from its kept set, a subset of the vocabulary; the
completion records those sets (`kept_ids`, `kept_offsets`: CSR, int32) and the TrainBatch carries them padded
(`kept`), so the trainer renormalises over the same sets (docs/algorithms.md, "Keep Sampling Mask").

Mixture-of-experts models under Keep Routing: the completion records the top-k experts the engine routed each position
of `prompt_ids + response_ids` to in every MoE layer (`routes`: positions 0 .. P + R - 2, the ones the engine ran;
the last sampled token was never fed back), and the TrainBatch carries them aligned with its tokens (`routes`), so
the trainer's routers use the same experts (docs/algorithms.md, "Keep Routing").

Image prompts (a vision-language model): `prompt_ids` are the engine's, each image placeholder expanded to its
image's tokens, and the completion keeps the images those tokens stand for, in order (`images`, encoded image
bytes); the TrainBatch carries each row's (`images`), so a trainer scores the same tokens with the same pixels.
A group's completions share one tuple of images: pickled together, its bytes cross once.
"""

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# Dtypes numpy holds without loss; others (bfloat16, ...) cross as tensors.
_NUMPY_DTYPES = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


class _NumpyOnTheWire:
    """Pickle the dataclass's CPU tensor fields as numpy arrays and restore them as tensors."""

    def __getstate__(self) -> dict[str, Any]:
        return {k: v.numpy() if _numpy_compatible(v) else v for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()})


def _numpy_compatible(v: Any) -> bool:
    return (
        isinstance(v, torch.Tensor)
        and v.device.type == "cpu"
        and v.dtype in _NUMPY_DTYPES
        and not v.requires_grad
        and type(v) is torch.Tensor
    )


@dataclass
class Completion(_NumpyOnTheWire):
    """One sampled response to a prompt, as the generator produced it."""

    prompt_ids: torch.Tensor  # int64 [P]
    response_ids: torch.Tensor  # int64 [R]
    logprobs: torch.Tensor  # float32 [R], behaviour logprob of each sampled token
    policy_versions: torch.Tensor  # int64 [R], weights version that sampled each token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""
    prompt: str = ""
    env_mask: torch.Tensor | None = None  # bool [R], True for tokens an environment inserted; None: none
    # the vLLM SamplingParams options it was drawn with (the generator's config and the call's overrides);
    # the replay buffer refuses what the trainer cannot reproduce. None: not made by a generator
    sampling: dict[str, Any] | None = None
    # truncated sampling: the ids response token i was drawn from are kept_ids[kept_offsets[i]:kept_offsets[i + 1]]
    # (none: the whole vocabulary, as for an environment's tokens). None: drawn from the whole vocabulary, or
    # not recorded because `kept_over_cap` of its tokens had more than generator.max_kept_tokens ids
    kept_ids: torch.Tensor | None = None  # int32 [N]
    kept_offsets: torch.Tensor | None = None  # int32 [R + 1]
    kept_over_cap: int = 0
    # Keep Routing: the experts the engine routed each position to, uint8 (or int16 past 256 experts)
    # [P + R - 1, MoE layers, top-k]; None: not recorded (a dense model, or a generator that does not record)
    routes: torch.Tensor | None = None
    # the images its image tokens stand for, in the order of those tokens (the prompt's, then for a multi-turn
    # trajectory those of the environment's turns): encoded image bytes (PNG). (): a text prompt
    images: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        for name in ("logprobs", "policy_versions", "env_mask"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"Completion.{name} has {len(getattr(self, name))} entries for {n} response tokens")
        if (self.kept_ids is None) != (self.kept_offsets is None):
            raise ValueError("Completion.kept_ids and kept_offsets come together (CSR): give both or neither")
        if self.kept_offsets is not None and (
            len(self.kept_offsets) != n + 1 or self.kept_offsets[0] != 0 or self.kept_offsets[-1] != len(self.kept_ids)
        ):
            raise ValueError(
                f"Completion.kept_offsets must hold {n + 1} offsets from 0 to len(kept_ids)="
                f"{len(self.kept_ids)}, got {len(self.kept_offsets)}"
            )
        ran = len(self.prompt_ids) + n - 1
        if self.routes is not None and (self.routes.ndim != 3 or len(self.routes) != ran):
            raise ValueError(
                f"Completion.routes must be [prompt + response - 1 = {ran}, layers, top-k], "
                f"got {list(self.routes.shape)}"
            )

    @property
    def routes_bytes(self) -> int:
        """Bytes its recorded routes take (0 when none are)."""
        return 0 if self.routes is None else self.routes.nbytes

    @property
    def kept_bytes(self) -> int:
        """Bytes its recorded kept sets take (0 when none are)."""
        return 0 if self.kept_ids is None else self.kept_ids.nbytes + self.kept_offsets.nbytes

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that contributed a token (what staleness is measured by)."""
        if len(self.policy_versions) == 0:
            raise ValueError("Completion has no response tokens, so no policy version")
        return int(self.policy_versions.min())


@dataclass
class Episode:
    """A completion with its reward(s) and advantage."""

    completion: Completion
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)  # per reward function, before weighting
    advantage: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        return self.completion.oldest_version


@dataclass
class Group:
    """The G episodes sampled from one prompt: the unit of storage and of advantage normalisation."""

    prompt_id: str
    episodes: list[Episode]

    def __post_init__(self) -> None:
        if not self.episodes:
            raise ValueError(f"Group {self.prompt_id!r} has no episodes")
        first = self.episodes[0].completion.prompt_ids
        for i, ep in enumerate(self.episodes[1:], start=1):
            if not torch.equal(ep.completion.prompt_ids, first):
                raise ValueError(f"Group {self.prompt_id!r}: episode {i} has a different prompt than episode 0")

    def __len__(self) -> int:
        return len(self.episodes)

    @property
    def oldest_version(self) -> int:
        return min(ep.oldest_version for ep in self.episodes)


@dataclass
class TrainBatch(_NumpyOnTheWire):
    """Right-padded tensors for one data-parallel rank. B sequences of length T.

    `tokens[b, t]` is the t-th token of prompt+response; the masks and per-token fields are
    aligned with it (`response_mask[b, t]` is True when token t is a response token the model sampled, the
    tokens the loss is over: an environment's tokens inside a multi-turn response are not).
    """

    tokens: torch.Tensor  # int64 [B, T]
    response_mask: torch.Tensor  # bool [B, T]
    behaviour_logprobs: torch.Tensor  # float32 [B, T], 0 outside the response
    policy_versions: torch.Tensor  # int64 [B, T], -1 outside the response
    advantages: torch.Tensor  # float32 [B] (group-relative), or [B, T] per token (PPO's GAE, 0 outside the response)
    ref_logprobs: torch.Tensor | None = None  # float32 [B, T]
    # int32 [B, T, K]: the kept set each token was drawn from (truncated sampling), -1 padded; a position
    # without ids (the prompt, an untruncated sample) is over the whole vocabulary. None: no truncation
    kept: torch.Tensor | None = None
    # int16 [B, T, MoE layers, top-k]: the experts the engine routed token t to (Keep Routing), -1 where it has none
    # (padding, each row's last token). None: no routes recorded
    routes: torch.Tensor | None = None
    rewards: torch.Tensor | None = None  # float32 [B], each episode's total reward (PPO's terminal reward)
    values: torch.Tensor | None = None  # float32 [B, T], PPO: the critic's value of each token before its update
    returns: torch.Tensor | None = None  # float32 [B, T], PPO: the critic's targets (GAE advantage + value)
    # row b's images (Completion.images: the pixels of its image tokens, in order), () for a text row. None: no
    # row has any
    images: list[tuple[bytes, ...]] | None = None

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def shape_only(self) -> "BatchShape":
        return BatchShape(self.num_sequences, self.num_response_tokens, self.num_tokens)

    @classmethod
    def collate(cls, episodes: list[Episode], pad_id: int, pad_to_multiple: int = 1) -> "TrainBatch":
        if not episodes:
            raise ValueError("TrainBatch.collate: no episodes")
        lengths = [len(e.completion.prompt_ids) + len(e.completion.response_ids) for e in episodes]
        T = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
        B = len(episodes)
        tokens = torch.full((B, T), pad_id, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.bool)
        logprobs = torch.zeros((B, T), dtype=torch.float32)
        versions = torch.full((B, T), -1, dtype=torch.long)
        advantages = torch.zeros(B, dtype=torch.float32)
        for b, ep in enumerate(episodes):
            c = ep.completion
            if ep.advantage is None:
                raise ValueError(f"TrainBatch.collate: episode {b} has no advantage")
            P, R = len(c.prompt_ids), len(c.response_ids)
            tokens[b, :P] = c.prompt_ids
            tokens[b, P : P + R] = c.response_ids
            mask[b, P : P + R] = True if c.env_mask is None else ~c.env_mask
            logprobs[b, P : P + R] = c.logprobs
            versions[b, P : P + R] = c.policy_versions
            advantages[b] = ep.advantage
        return cls(
            tokens,
            mask,
            logprobs,
            versions,
            advantages,
            kept=collate_kept(episodes, T),
            routes=collate_routes(episodes, T),
            rewards=torch.tensor([float(ep.reward) for ep in episodes], dtype=torch.float32),
            images=[ep.completion.images for ep in episodes] if any(ep.completion.images for ep in episodes) else None,
        )


def collate_kept(episodes: list[Episode], T: int) -> torch.Tensor | None:
    """The episodes' kept sets as one [B, T, K] int32 tensor, -1 padded (K: the largest set), aligned with the
    tokens; None when no episode records any."""
    recorded = [(b, ep.completion) for b, ep in enumerate(episodes) if ep.completion.kept_offsets is not None]
    if not recorded:
        return None
    K = max([int((c.kept_offsets[1:] - c.kept_offsets[:-1]).max()) for _, c in recorded if len(c.response_ids)] or [1])
    kept = torch.full((len(episodes), T, max(K, 1)), -1, dtype=torch.int32)
    for b, c in recorded:
        offsets = c.kept_offsets.long()
        sizes = offsets[1:] - offsets[:-1]
        position = torch.arange(len(sizes)).repeat_interleave(sizes)  # the response token of each id
        column = torch.arange(len(c.kept_ids)) - offsets[position]
        kept[b, len(c.prompt_ids) + position, column] = c.kept_ids.int()
    return kept


def collate_routes(episodes: list[Episode], T: int) -> torch.Tensor | None:
    """The episodes' routes as one [B, T, layers, top-k] int16 tensor aligned with the tokens, -1 where a row has
    none; None when no episode records any."""
    recorded = [(b, ep.completion.routes) for b, ep in enumerate(episodes) if ep.completion.routes is not None]
    if not recorded:
        return None
    shape = recorded[0][1].shape[1:]
    routes = torch.full((len(episodes), T, *shape), -1, dtype=torch.int16)
    for b, r in recorded:
        if r.shape[1:] != shape:
            raise ValueError(
                f"episode {b}'s routes are {list(r.shape[1:])} (layers, top-k), episode "
                f"{recorded[0][0]}'s {list(shape)}: not one model's"
            )
        routes[b, : len(r)] = r.to(torch.int16)
    return routes


@dataclass(frozen=True)
class BatchShape:
    """What a trainer rank needs to know of another rank's batch: its counts (the loss is normalised by the
    whole step's), not its tensors. The run sends each rank its own TrainBatch and the others' BatchShapes."""

    num_sequences: int
    num_response_tokens: int
    num_tokens: int
