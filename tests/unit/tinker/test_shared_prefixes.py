"""A forward_backward's rows that share their first tokens (a sampled group's completions of one prompt) are
forwarded with the prompt once (forge_rl/tinker/shared_prefixes.py): every target's logprob and the gradients are
those of the rows forwarded whole, on the trainer's own logprob forward over the embedded tiny model."""

import pytest
import torch

from forge_rl.tinker.shared_prefixes import SharedPrefixes
from tests.support.precision import trainer_step


def rows_of_two_prompts(template: int = 0):
    """Two groups (3 and 2 completions of different lengths) and a lone row, every row starting with the same
    `template` tokens (a chat template's start); each row's token count - 1 targets."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(3, 100, (template,), generator=g)
    first, second = torch.randint(3, 100, (24,), generator=g), torch.randint(3, 100, (20,), generator=g)
    second[0] = first[0]  # the two prompts also share their first token: the groups part at different depths
    rows = [torch.cat([first, torch.randint(3, 100, (n,), generator=g)]) for n in (4, 7, 2)]
    rows += [torch.cat([second, torch.randint(3, 100, (n,), generator=g)]) for n in (5, 3)]
    rows.append(torch.randint(3, 100, (8,), generator=g))
    rows = [torch.cat([start, r]) for r in rows]
    lengths = [len(r) - 1 for r in rows]
    tokens = torch.zeros(len(rows), max(lengths) + 1, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    return tokens, lengths


@pytest.mark.parametrize("template", [0, 10])
def test_runs_of_a_shared_prefix_are_found_and_each_row_keeps_a_target_after_it(template):
    """With a start every row shares (a chat template's), the groups are still told apart where they part."""
    tokens, lengths = rows_of_two_prompts(template)
    plan = SharedPrefixes.of(tokens, lengths)
    assert [rows for rows, _ in plan.runs] == [[0, 1, 2], [3, 4]]
    assert plan.runs[0][1] >= template + 24 and plan.runs[1][1] >= template + 20
    for b, length in enumerate(lengths):  # every target is computed once: in its row or in its run's prefix row
        (run,) = [r for r, (rows, _) in enumerate(plan.runs) if b in rows] or [None]
        prefix = plan.runs[run][1] if run is not None else 1
        assert plan.mask[b, prefix : length + 1].all() and not plan.mask[b, :prefix].any()
        assert plan.mask[b, length + 1 :].sum() == 0


def test_logprobs_and_gradients_are_the_whole_rows_and_the_prompts_are_forwarded_once():
    tokens, lengths = rows_of_two_prompts()
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for b, length in enumerate(lengths):
        mask[b, 1 : length + 1] = True
    shared, whole = trainer_step("float32", share_prompts=True), trainer_step("float32", share_prompts=False)
    weights = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(1))  # a loss on every target
    plan = SharedPrefixes.of(tokens, lengths)
    got = plan.per_row(shared.logprobs(tokens, "none", plan.mask, prompt_targets=True)[0])
    assert shared.last_forward_tokens < 0.75 * tokens.numel()  # packed: the two prompts forwarded once each
    want, _ = whole.logprobs(tokens, "none", mask)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert (got[mask] != 0).all() and (got[~mask] == 0).all()
    unpacked = plan.per_row(whole.logprobs(tokens, "none", plan.mask, prompt_targets=True)[0])  # no packing
    assert torch.allclose(unpacked, want, atol=1e-5)
    ((got * weights).sum() + (want * weights).sum()).backward()  # two models: each takes its own gradient
    for (name, a), b in zip(shared.module.named_parameters(), whole.module.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-3), name
