"""Greedy held-out evaluation of a generator service: any task's held-out set scored by the run's reward
actor (`evaluate_task`), or the arithmetic task by exact match (`greedy_accuracy`, which the SFT app uses).

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
from forge_rl.rewards.workers import RewardError


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


async def evaluate_task(generator, reward, examples, eval_reward: str, max_tokens: int = 8,
                        concurrency: int = 64) -> dict[str, Any]:
    """Greedy completions of a task's held-out examples (rendered, `TaskExample.text`), scored by the run's
    reward actor. Returns {"accuracy": mean of `eval_reward`'s values, "reward": mean total reward, "n",
    "finished": fraction that ended on their own, not at max_tokens}."""
    if not examples:
        raise ValueError("evaluate_task: no held-out examples")
    slots = asyncio.Semaphore(concurrency)

    async def one(example):
        async with slots:
            return (await generator.generate.route(example.text, n=1, temperature=0.0, max_tokens=max_tokens))[0]

    completions = await asyncio.gather(*(one(e) for e in examples))
    names = sorted({k for e in examples for k in e.columns})
    missing = [(e.where, k) for e in examples for k in names if k not in e.columns]
    if missing:
        raise ValueError(f"evaluate_task: held-out row {missing[0][0]} has no column {missing[0][1]!r}")
    try:
        totals, parts = await _score(reward, examples, completions, names)
    except Exception as e:  # a reward failed on the held-out set: score each example alone, a failed one as 0
        if not isinstance(getattr(e, "exception", e), RewardError):
            raise
        totals, parts = await _score_each(reward, examples, completions, names, eval_reward)
    if eval_reward not in parts:
        raise ValueError(f"task.eval_reward={eval_reward!r} is not one of the run's rewards {sorted(parts)}")
    n = len(examples)
    return {"accuracy": sum(parts[eval_reward]) / n, "reward": sum(totals) / n, "n": n,
            "finished": sum(c.finish_reason == "stop" for c in completions) / n}


async def _score(reward, examples, completions, names: list[str]) -> tuple[list[float], dict[str, list[float]]]:
    return await reward.score.call_one(
        [e.prompt for e in examples], [c.text for c in completions], [c.finish_reason for c in completions],
        {k: [e.columns[k] for e in examples] for k in names},
    )


async def _score_each(reward, examples, completions, names: list[str],
                      eval_reward: str) -> tuple[list[float], dict[str, list[float]]]:
    """Every example scored on its own; one whose reward fails (a RewardError) scores 0 in every part."""
    async def one(e, c):
        try:
            return await _score(reward, [e], [c], names)
        except Exception as error:
            if not isinstance(getattr(error, "exception", error), RewardError):
                raise
            return None

    scored = await asyncio.gather(*(one(e, c) for e, c in zip(examples, completions)))
    part_names = next((list(s[1]) for s in scored if s is not None), [eval_reward])
    failed = sum(s is None for s in scored)
    print(f"evaluation: the rewards failed on {failed} of {len(examples)} held-out examples (scored 0)", flush=True)
    totals = [s[0][0] if s is not None else 0.0 for s in scored]
    parts = {k: [s[1][k][0] if s is not None else 0.0 for s in scored] for k in part_names}
    return totals, parts
