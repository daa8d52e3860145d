"""What the Generator assembles from vLLM's streamed outputs: per completion, the sampled ids, their behaviour
logprobs and policy versions, and, under truncated sampling (top_p, top_k, min_p), each token's kept set.

The kept set is read from the processed logprobs (logprobs_mode="processed_logprobs"): a request for k logprobs
returns the k most likely tokens of the distribution the token was drawn from, and every token outside the kept
set has logprob -inf there. Asked for `cap` + 1, the finite entries are the whole kept set when there are at most
`cap` of them; with `cap` + 1 finite entries the set is larger than the generator records, and the completion is
marked (`over_cap`) instead: the trainer could not reproduce it (docs/algorithms.md, "Keep Sampling Mask").
"""

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from forge_rl.types import Completion


class Child:
    """One of the n completions of a request, accumulated from streamed deltas. `cap`: record each token's kept set
    of at most `cap` ids (truncated sampling; the request asked for cap + 1 logprobs), None: record none."""

    def __init__(self, cap: int | None = None) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.cap = cap
        self.kept_ids: list[int] = []  # CSR: token i's ids are kept_ids[kept_offsets[i]:kept_offsets[i + 1]]
        self.kept_offsets: list[int] = [0]
        self.over_cap = 0  # tokens whose kept set had more than `cap` ids
        self.routes = None  # numpy [positions, layers, top-k]: Keep Routing's record of the engine's experts

    def extend(self, delta) -> None:
        new = list(delta.token_ids)
        self.ids += new
        self.logprobs += [lp[t].logprob for lp, t in zip(delta.logprobs or [], new)]
        if self.cap is not None:
            for lp in delta.logprobs or []:
                self.keep(lp)
        if getattr(delta, "routed_experts", None) is not None:  # vLLM's own record (Model Runner V2, GPU)
            self.routes = delta.routed_experts
        if delta.finish_reason is not None:
            self.finish_reason = str(delta.finish_reason)
            self.versions = versions_from_spans(delta.weight_versions, len(self.ids))

    def keep(self, logprobs: dict) -> None:
        """Record one token's kept set from its processed logprobs (token id -> Logprob)."""
        kept = [t for t, lp in logprobs.items() if lp.logprob > -math.inf]
        if len(kept) > self.cap:
            self.over_cap += 1
            kept = []
        self.kept_ids += kept
        self.kept_offsets.append(len(self.kept_ids))


def versions_from_spans(spans, n_tokens: int) -> list[int]:
    """Per-token policy versions from vLLM's weight-version spans ([start, end) of output tokens per label)."""
    if not n_tokens:
        return []
    if not spans:
        raise RuntimeError("the vLLM engine reported no weight versions for a finished sequence")
    versions = [-1] * n_tokens
    for span in spans:
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    if -1 in versions or len(versions) != n_tokens:
        raise RuntimeError(f"weight-version spans {spans} do not cover the {n_tokens} tokens of a sequence")
    return versions


def completion_routes(child: Child, prompt_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Keep Routing: the child's recorded experts of positions 0 .. prompt + response - 2 (the ones the engine ran),
    as Completion.routes holds them. vLLM's own record (GPU) and forge_rl's recorder (CPU) both come as
    [positions, layers, top-k]; a record that misses a position fails here, naming what is missing."""
    ran = prompt_len + len(child.ids) - 1
    routes = child.routes
    if routes is None or len(routes) < ran or (routes[:ran] < 0).any():
        have = "no positions" if routes is None else f"{int((routes[:ran] >= 0).all(axis=(1, 2)).sum())} positions"
        raise RuntimeError(
            f"Keep Routing: the engine recorded {have} of the {ran} positions of a completion "
            f"(prompt {prompt_len}, response {len(child.ids)} tokens); is prefix caching on "
            "(generator.engine_args.enable_prefix_caching)?"
        )
    return torch.from_numpy(np.ascontiguousarray(routes[:ran])).to(dtype)


def completion_of(
    prompt: str | list[int],
    prompt_ids: list[int],
    child: Child,
    sampling: dict[str, Any],
    text: str,
    routes: torch.Tensor | None = None,
) -> Completion:
    """A finished child as the Completion the Generator returns: its kept sets when it recorded every token's (none
    over the cap), its `routes` under Keep Routing. `prompt` as the caller gave it (token ids leave
    Completion.prompt empty); `sampling`: the parameters it was drawn with."""
    kept = {}
    if child.cap is not None and not child.over_cap:
        kept = dict(
            kept_ids=torch.tensor(child.kept_ids, dtype=torch.int32),
            kept_offsets=torch.tensor(child.kept_offsets, dtype=torch.int32),
        )
    if routes is not None:
        kept["routes"] = routes
    return Completion(
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.long),
        response_ids=torch.tensor(child.ids, dtype=torch.long),
        logprobs=torch.tensor(child.logprobs, dtype=torch.float32),
        policy_versions=torch.tensor(child.versions, dtype=torch.long),
        finish_reason=child.finish_reason,
        text=text,
        prompt=prompt if isinstance(prompt, str) else "",
        sampling=sampling,
        kept_over_cap=child.over_cap,
        **kept,
    )


def filler_completion(c: Completion, eos_ids: set[int], tokenizer) -> Completion:
    """A completion that ran past its end (ignore_eos) as a response of that length: its text ends at the first
    end-of-sequence token (finish_reason "stop"; "length" when it has none) and the tokens after that token are
    filler, marked in env_mask: generated, and forwarded by the trainer, but out of the loss, so that what is
    learned is what the same response without filler teaches."""
    ids = c.response_ids.tolist()
    end = next((i for i, t in enumerate(ids) if t in eos_ids), None)
    if end is None:
        return dataclasses.replace(c, finish_reason="length")
    filler = torch.arange(len(ids)) > end
    return dataclasses.replace(
        c,
        text=tokenizer.decode(ids[:end], skip_special_tokens=True),
        finish_reason="stop",
        env_mask=filler if bool(filler.any()) else None,
    )
