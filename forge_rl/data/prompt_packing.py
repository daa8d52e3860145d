"""Shared-prompt packing: the G responses of a group train against one copy of their prompt.

A GRPO batch holds G sequences per prompt, each `prompt + response`. Computed row by row, every prompt
token runs forward and backward G times. Packed, a group becomes one row `prompt, r_1, ..., r_G`:
positions restart at len(prompt) for every response, and an attention mask lets each response see the
prompt and its own earlier tokens only. Every response token then sees exactly the context it had
unpacked, so logprobs, loss and gradients are the same function of the weights (to rounding), for
a fraction of the tokens: with the demo's 25-token prompts and answers of up to 8 tokens, at most 89
tokens per group instead of 8 x 33 = 264.

Attention in a packed row costs O(L^2) for L = P + G x R tokens, against G x (P + R)^2 unpacked (causal:
half of it), so the tokens saved are not the whole story when rows grow long. `plan_packing` weighs both: a row
of length L costs L x (1 + a x L), `a` being attention's cost per (query, key) pair in units of one token's
cost through the linear layers (forge_rl.models.qwen3_config.attention_pair_cost), and it packs only when the
packed rows cost at most `max_fraction` of the unpacked batch and stay within `max_len`. The unpacked batch's
rows are counted at its full width (right padding is computed too) and at half their pairs (causal).

The logits at packed position j predict the token at j + 1 only inside one segment; the first token of
every response is predicted by the prompt's last position. `pred_index` says, for each response token
of the original [B, T] batch, which flat packed position's logits predict it.
"""

from dataclasses import dataclass

import torch


@dataclass
class PromptPacked:
    tokens: torch.Tensor  # int64 [N, L]
    positions: torch.Tensor  # int64 [N, L], RoPE positions: each response restarts after the prompt
    attention_mask: torch.Tensor  # bool [N, 1, L, L], True = query may attend to key
    pred_index: torch.Tensor  # int64 [M], flat index into N * L of the logits predicting each target
    targets: torch.Tensor  # int64 [M], the response tokens
    rows: torch.Tensor  # int64 [M], row of each target in the unpacked batch
    cols: torch.Tensor  # int64 [M], column of each target in the unpacked batch
    # int64 [N, L]: the flat index into the unpacked [B, T] of the token at each packed place (a prompt's: its
    # group's first row's), -1 for padding. Per-token inputs (Keep Routing's routes) are packed through it
    source: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def _spans(response_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(prompt length, response length) of every row: the response runs from its first to its last response
    token. Tokens inside it that are not response tokens (an environment's turn in a multi-turn response) are
    packed with it, as context the loss does not see."""
    out = []
    for b, row in enumerate(response_mask):
        idx = torch.nonzero(row).flatten()
        if len(idx) == 0:
            raise ValueError(f"row {b} has no response tokens")
        start = int(idx[0])
        out.append((start, int(idx[-1]) - start + 1))
    return out


def _groups(tokens: torch.Tensor, spans: list[tuple[int, int]], row_keys: list | None) -> list[list[int]]:
    """Runs of consecutive rows with the same prompt (the buffer collates a group's rows together) and the same
    key: a row's images, without which two prompts of other images but the same ids would be one."""
    groups: list[list[int]] = []
    for b, (p, _) in enumerate(spans):
        if groups:
            first = groups[-1][0]
            same_key = row_keys is None or row_keys[first] == row_keys[b]
            if same_key and spans[first][0] == p and torch.equal(tokens[first, :p], tokens[b, :p]):
                groups[-1].append(b)
                continue
        groups.append([b])
    return groups


def plan_packing(
    tokens: torch.Tensor,
    response_mask: torch.Tensor,
    max_fraction: float = 0.9,
    max_len: int = 1024,
    pair_cost: float = 0.0,
    row_keys: list | None = None,
    prompt_targets: bool = False,
) -> PromptPacked | None:
    """The packed form of these rows, or None when packing would not save enough (see the module doc).
    `pair_cost` = 0 weighs tokens only. `row_keys`: what else rows must share to share a prompt (their images).
    `prompt_targets`: a prompt's own tokens after its first are targets too (a Tinker datum's), computed once per
    group, in its first row (`before_responses`)."""
    spans = _spans(response_mask)
    groups = _groups(tokens, spans, row_keys)
    lengths = [spans[g[0]][0] + sum(spans[b][1] for b in g) for g in groups]
    L = max(lengths)
    B, T = tokens.shape
    packed_cost = len(groups) * L * (1 + pair_cost * L)
    unpacked_cost = B * T * (1 + pair_cost * T / 2)
    if L > max_len or packed_cost > max_fraction * unpacked_cost:
        return None
    return pack(tokens, spans, groups, L, prompt_targets)


def before_responses(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each row's prompt tokens after its first, the places of a prompt's own targets."""
    columns = torch.arange(response_mask.shape[1])
    first = response_mask.long().argmax(1)  # each row's first response token
    return (columns >= 1) & (columns < first[:, None])


def pack(
    tokens: torch.Tensor, spans: list[tuple[int, int]], groups: list[list[int]], L: int, prompt_targets: bool = False
) -> PromptPacked:
    N = len(groups)
    packed = torch.zeros(N, L, dtype=torch.long)
    positions = torch.zeros(N, L, dtype=torch.long)
    segment = torch.full((N, L), -1, dtype=torch.long)  # 0 = prompt, i = response i, -1 = padding
    source = torch.full((N, L), -1, dtype=torch.long)
    T = tokens.shape[1]
    pred, targets, rows, cols = [], [], [], []
    for n, group in enumerate(groups):
        P = spans[group[0]][0]
        packed[n, :P] = tokens[group[0], :P]
        positions[n, :P] = torch.arange(P)
        segment[n, :P] = 0
        source[n, :P] = group[0] * T + torch.arange(P)
        if prompt_targets and P > 1:  # token j of the prompt is predicted by token j - 1, for the group's first row
            pred.append(n * L + torch.arange(P - 1))
            targets.append(tokens[group[0], 1:P])
            rows.append(torch.full((P - 1,), group[0]))
            cols.append(torch.arange(1, P))
        at = P
        for i, b in enumerate(group, start=1):
            R = spans[b][1]
            packed[n, at : at + R] = tokens[b, P : P + R]
            positions[n, at : at + R] = torch.arange(P, P + R)
            segment[n, at : at + R] = i
            source[n, at : at + R] = b * T + torch.arange(P, P + R)
            # token j of the response is predicted by the prompt's last position (j = 0) or by token j - 1
            pred.append(n * L + torch.cat([torch.tensor([P - 1]), torch.arange(at, at + R - 1)]))
            targets.append(tokens[b, P : P + R])
            rows.append(torch.full((R,), b))
            cols.append(torch.arange(P, P + R))
            at += R
    q, k = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = causal & (q >= 0) & ((k == 0) | (k == q))
    mask |= torch.eye(L, dtype=torch.bool)  # padding attends to itself: no all-masked row (NaN in softmax)
    return PromptPacked(
        packed, positions, mask[:, None], torch.cat(pred), torch.cat(targets), torch.cat(rows), torch.cat(cols), source
    )
