"""Shared prompts among a forward_backward's rows, so that the trainer forwards a group's prompt once.

A Tinker datum is a whole sequence whose every token after the first is a target: the trainer is not told where a
prompt ends. A sampled group's G completions of one prompt arrive as G consecutive datums that begin with the same
tokens. Here those runs are found, and each run's rows are marked from the end of their common prefix, so the
trainer's shared-prompt packing (forge_rl/data/prompt_packing.py) forwards the prefix once, then each row's rest.
The prefix's own targets are computed once too, in the run's first row (`prompt_targets`), and copied to the
others: the logits at a position depend only on the tokens up to it, so they are the same function of the weights.

    plan = SharedPrefixes.of(tokens, lengths)                  # [B, T] rows, each row's number of targets
    logprobs, _ = model.logprobs(tokens, "none", plan.mask, prompt_targets=True)
    logprobs = plan.per_row(logprobs)                           # [B, T]: every target's, as unpacked
"""

from dataclasses import dataclass

import torch


@dataclass
class SharedPrefixes:
    mask: torch.Tensor  # [B, T]: each row's targets after its run's prefix (all of a row in no run)
    runs: list[tuple[list[int], int]]  # each run's rows and prefix length P (its rows share tokens 0..P-1)

    @classmethod
    def of(cls, tokens: torch.Tensor, lengths: list[int], min_prefix: int = 2) -> "SharedPrefixes":
        """Runs of consecutive rows sharing at least `min_prefix` first tokens. Row b's tokens are
        tokens[b, :lengths[b] + 1] and its targets sit at positions 1..lengths[b]; a row keeps at least one
        target after its run's prefix. Every row of a batch may start alike (a chat template's start): a group's
        rows share their prompt beyond it, so two neighbours sharing under half of what either shares with its
        other neighbour are in different runs."""
        shared = [_common(tokens[b - 1], tokens[b], min(lengths[b - 1], lengths[b])) for b in range(1, len(lengths))]
        with_next = [*shared, 0]
        best = [max(before, after) for before, after in zip([0, *shared], with_next)]  # the most a row shares
        runs: list[tuple[list[int], int]] = []
        for b, length in enumerate(lengths):
            if b and shared[b - 1] >= min_prefix and 2 * shared[b - 1] >= max(best[b - 1], best[b]):
                rows, prefix = runs[-1]
                runs[-1] = (rows + [b], min(prefix, shared[b - 1]))
            else:
                runs.append(([b], length))
        runs = [(rows, prefix) for rows, prefix in runs if len(rows) > 1]
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        for b, length in enumerate(lengths):
            mask[b, 1 : length + 1] = True
        for rows, prefix in runs:
            mask[rows, :prefix] = False
        return cls(mask, runs)

    def per_row(self, logprobs: torch.Tensor) -> torch.Tensor:
        """[B, T]: each row's logprobs, its run's prefix targets taken from the run's first row."""
        if not self.runs:
            return logprobs
        B, T = logprobs.shape
        source = torch.arange(B)[:, None].expand(B, T).clone()
        columns = torch.arange(T)
        for rows, prefix in self.runs:
            source[rows] = torch.where(columns < prefix, rows[0], source[rows])
        return logprobs.gather(0, source.to(logprobs.device))


def _common(a: torch.Tensor, b: torch.Tensor, n: int) -> int:
    """How many first tokens of `a` and `b` are the same, at most `n`."""
    return int((a[:n] == b[:n]).long().cumprod(0).sum())
