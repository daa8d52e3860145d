"""Greedy held-out evaluation of a generator service on the arithmetic task.

    from forge_rl.data.arithmetic import held_out_problems
    result = await greedy_accuracy(generator, tokenizer, held_out_problems(500))
    # {"accuracy": 0.36, "n": 500, "format_ok": 0.99}

`generator` is anything with `.generate.route(prompt, n=1, **sampling) -> list[Completion]` (a
`Generator` service, or a single replica wrapped the same way). Decoding is greedy (temperature 0), so
the number is deterministic for given weights; a completion is correct when, stripped of whitespace, it
equals the answer (the exact-match reward GRPO trains on).
"""

import asyncio
from typing import Any

from forge_rl.data.arithmetic import Problem, chat_prompt
from forge_rl.rewards.exact_match import exact_match


async def greedy_completions(
    generator, tokenizer, problems: list[Problem], max_tokens: int = 8, concurrency: int = 64,
    chat_template_kwargs: dict | None = None,
) -> list[str]:
    """Greedy completion text of each problem, in the order given."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    slots = asyncio.Semaphore(concurrency)

    async def one(problem: Problem) -> str:
        async with slots:
            completions = await generator.generate.route(
                chat_prompt(tokenizer, problem, **(chat_template_kwargs or {})), n=1, temperature=0.0, max_tokens=max_tokens
            )
            return completions[0].text

    return list(await asyncio.gather(*(one(p) for p in problems)))


async def greedy_accuracy(
    generator, tokenizer, problems: list[Problem], max_tokens: int = 8, concurrency: int = 64,
    chat_template_kwargs: dict | None = None,
) -> dict[str, Any]:
    """Greedy exact-match accuracy on `problems`.

    Returns {"accuracy": fraction correct, "n": number of problems, "format_ok": fraction of answers
    that are only digits (after stripping whitespace)}.
    """
    if not problems:
        raise ValueError("greedy_accuracy: no problems to evaluate")
    texts = await greedy_completions(generator, tokenizer, problems, max_tokens, concurrency, chat_template_kwargs)
    correct = exact_match([p.question for p in problems], texts, answer=[p.answer for p in problems])
    n = len(problems)
    return {
        "accuracy": sum(correct) / n,
        "n": n,
        "format_ok": sum(t.strip().isdigit() for t in texts) / n,
    }
