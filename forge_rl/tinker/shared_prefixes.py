"""Shared prompts among a forward_backward's rows, so that the trainer forwards a group's prompt once.

A Tinker datum is a whole sequence whose every token after the first is a target: the trainer is not told where a
prompt ends. A sampled group's G completions of one prompt arrive as G consecutive datums that begin with the same
tokens. Here those runs are found, and each becomes:

- its rows with only the tokens after the common prefix marked, which the trainer's shared-prompt packing
  (forge_rl/data/prompt_packing.py) forwards as one row: the prefix once, then each row's rest;
- one extra row holding the prefix alone, whose logprobs are the prefix's targets' for every row of the run (the
  logits at a position depend only on the tokens up to it, so they are the same function of the weights).

    plan = SharedPrefixes.of(tokens, lengths)                  # [B, T] rows, each row's number of targets
    logprobs, _ = model.logprobs(plan.tokens, "none", plan.mask)
    logprobs = plan.per_row(logprobs)                           # [B, T]: every target's, as unpacked
"""

from dataclasses import dataclass

import torch


@dataclass
class SharedPrefixes:
    tokens: torch.Tensor  # [B + R, T]: the rows, then one row per run holding its prefix
    mask: torch.Tensor  # [B + R, T]: the positions whose logprobs are computed in that row
    runs: list[tuple[list[int], int]]  # each run's rows and prefix length P (its rows share tokens 0..P-1)

    @classmethod
    def of(cls, tokens: torch.Tensor, lengths: list[int], min_prefix: int = 2) -> "SharedPrefixes":
        """Runs of consecutive rows sharing at least `min_prefix` first tokens. Row b's tokens are
        tokens[b, :lengths[b] + 1] and its targets sit at positions 1..lengths[b]; a row keeps at least one
        target after its run's prefix."""
        runs: list[tuple[list[int], int]] = []
        for b, length in enumerate(lengths):
            if runs:
                rows, prefix = runs[-1]
                n = min(prefix, length)
                same = (tokens[rows[0], :n] == tokens[b, :n]).long().cumprod(0).sum()
                if int(same) >= min_prefix:
                    runs[-1] = (rows + [b], int(same))
                    continue
            runs.append(([b], length))
        runs = [(rows, prefix) for rows, prefix in runs if len(rows) > 1]
        B, T = tokens.shape
        out = torch.cat([tokens, torch.zeros(len(runs), T, dtype=tokens.dtype)])
        mask = torch.zeros_like(out, dtype=torch.bool)
        for b, length in enumerate(lengths):
            mask[b, 1 : length + 1] = True
        for r, (rows, prefix) in enumerate(runs):
            out[B + r, :prefix] = tokens[rows[0], :prefix]
            mask[B + r, 1:prefix] = True
            mask[rows, :prefix] = False
        return cls(out, mask, runs)

    def per_row(self, logprobs: torch.Tensor) -> torch.Tensor:
        """[B, T] from the [B + R, T] logprobs of `tokens`: each row's prefix targets taken from its run's row."""
        B = self.tokens.shape[0] - len(self.runs)
        out = logprobs[:B]
        if not self.runs:
            return out
        source = torch.arange(B)[:, None].expand(B, logprobs.shape[1]).clone()
        columns = torch.arange(logprobs.shape[1])
        for r, (rows, prefix) in enumerate(self.runs):
            source[rows] = torch.where(columns < prefix, B + r, source[rows])
        return logprobs.gather(0, source.to(logprobs.device))
