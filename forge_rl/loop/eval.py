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
from forge_rl.data.vision import image_args
from forge_rl.rewards.exact_match import exact_match
from forge_rl.actors.reward import RewardRoleDied
from forge_rl.agents.evaluation import evaluate_agent
from forge_rl.envs import env_factory
from forge_rl.envs.environment import EVAL_TRAJECTORIES
from forge_rl.loop.multiturn import Trajectory, drop_reason, play_group, trajectory_scores
from forge_rl.loop.turn_renderer import TurnRenderer
from forge_rl.deps.monarch import SupervisionError

RETRY_PROBE = 8  # examples a failed eval reward is retried on alone before the rest are tried too
LINE = 300  # characters of a failure's line at most


class EvalFailures:
    """The held-out examples an evaluation could not score, by cause (the counted drop reason: agent_error,
    env_error, ...): reported as one line per cause with how many examples it cost and the first one's id and
    error, so an agent or environment that fails on every example is one line, not one per held-out example."""

    def __init__(self, total: int):
        self.total = total
        self.causes: dict[str, list] = {}  # cause -> [examples, the first one's id, its error's first line]

    def add(self, example_id: str, cause: str, message: str) -> None:
        if cause in self.causes:
            self.causes[cause][0] += 1
        else:
            self.causes[cause] = [1, example_id, (str(message).splitlines() or [""])[0]]

    def lines(self) -> list[str]:
        return [
            f"evaluation: {count} of {self.total} held-out examples failed ({cause}), scored as not solved; the "
            f"first, example {first}: {message}"[:LINE]
            for cause, (count, first, message) in self.causes.items()
        ]

    def report(self) -> None:
        for line in self.lines():
            print(line, flush=True)


async def greedy_completions(
    generator,
    tokenizer,
    problems: list[Problem],
    max_tokens: int = 8,
    concurrency: int = 64,
    chat_template_kwargs: dict | None = None,
) -> list[str]:
    """Greedy completion text of each problem, in the order given."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    slots = asyncio.Semaphore(concurrency)

    async def one(problem: Problem) -> str:
        async with slots:
            completions = await generator.generate.route(
                chat_prompt(tokenizer, problem, **(chat_template_kwargs or {})),
                n=1,
                temperature=0.0,
                max_tokens=max_tokens,
            )
            return completions[0].text

    return list(await asyncio.gather(*(one(p) for p in problems)))


async def greedy_accuracy(
    generator,
    tokenizer,
    problems: list[Problem],
    max_tokens: int = 8,
    concurrency: int = 64,
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
    return {"accuracy": sum(correct) / n, "n": n, "format_ok": sum(t.strip().isdigit() for t in texts) / n}


async def evaluate_task(
    generator, reward, examples, eval_reward: str, max_tokens: int = 8, concurrency: int = 64
) -> dict[str, Any]:
    """Greedy completions of a task's held-out examples (rendered, `TaskExample.text`), scored by the run's
    reward actor. Returns {"accuracy": mean of `eval_reward`'s values, "reward": mean total reward, "n",
    "finished": fraction that ended on their own, not at max_tokens}. Each reward is scored on its own: one
    that fails scores 0 in that reward only (the eval reward is first retried example by example), so a
    failing reward never changes another's score."""
    if not examples:
        raise ValueError("evaluate_task: no held-out examples")
    slots = asyncio.Semaphore(concurrency)

    async def one(example):
        async with slots:
            return (
                await generator.generate.route(
                    example.text, n=1, temperature=0.0, max_tokens=max_tokens, **image_args(example)
                )
            )[0]

    completions = await asyncio.gather(*(one(e) for e in examples))
    names = sorted({k for e in examples for k in e.columns})
    missing = [(e.where, k) for e in examples for k in names if k not in e.columns]
    if missing:
        raise ValueError(f"evaluate_task: held-out row {missing[0][0]} has no column {missing[0][1]!r}")
    parts = await _score_each_reward(reward, examples, completions, names)
    if eval_reward not in parts:
        raise ValueError(f"task.eval_reward={eval_reward!r} is not one of the run's rewards {sorted(parts)}")
    failed = {name: error for name, error in parts.items() if isinstance(error, str)}
    for name, error in failed.items():
        # the eval reward is retried example by example (one bad example costs that example); another
        # failed reward only enters the mean total reward, as 0 (no retries of a reward that may hang)
        values = (
            await _one_reward_each(reward, examples, completions, names, name)
            if name == eval_reward
            else [None] * len(examples)
        )
        lost = sum(v is None for v in values)
        print(
            f"evaluation: reward {name!r} failed on {lost} of {len(examples)} held-out examples (scored 0 in "
            f"that reward only): {error}".splitlines()[0][:300],
            flush=True,
        )
        parts[name] = [0.0 if v is None else v for v in values]
    weights = await reward.weights.call_one()
    totals = [sum(weights[k] * v[i] for k, v in parts.items()) for i in range(len(examples))]
    n = len(examples)
    return {
        "accuracy": sum(parts[eval_reward]) / n,
        "reward": sum(totals) / n,
        "n": n,
        "finished": sum(c.finish_reason == "stop" for c in completions) / n,
    }


async def _score_each_reward(
    reward, examples, completions, names: list[str], only: list[str] | None = None
) -> dict[str, list[float] | str]:
    """Each reward's values on `examples` (or its error's message), scored independently of the others."""
    try:
        return await reward.score_each_reward.call_one(
            [e.prompt for e in examples],
            [c.text for c in completions],
            [c.finish_reason for c in completions],
            {k: [e.columns[k] for e in examples] for k in names},
            only,
        )
    except Exception as e:
        failure = getattr(e, "exception", e)
        if isinstance(failure, RewardRoleDied):  # a reward model's actor died: the run's to report
            raise failure from None
        raise


async def _one_reward_each(reward, examples, completions, names: list[str], name: str) -> list[float | None]:
    """Reward `name` on each example alone: its value, or None where it failed. When it fails on each of the first
    RETRY_PROBE examples, the rest are not tried (a reward that hangs would cost reward_timeout_s per example)."""

    async def one(e, c):
        values = (await _score_each_reward(reward, [e], [c], names, [name]))[name]
        return None if isinstance(values, str) else values[0]

    probe = list(await asyncio.gather(*(one(e, c) for e, c in zip(examples[:RETRY_PROBE], completions))))
    if all(v is None for v in probe):
        return probe + [None] * (len(examples) - len(probe))
    rest = await asyncio.gather(*(one(e, c) for e, c in zip(examples[RETRY_PROBE:], completions[RETRY_PROBE:])))
    return probe + list(rest)


async def evaluate_held_out(
    cfg, generator, reward, held_out: list, tokenizer, eval_reward: str, agents=None
) -> dict[str, float]:
    """`eval/accuracy`: the mean of the eval reward over the held-out examples, greedy (NaN when the task has
    none); with an environment (cfg.env), the fraction solved within env.max_turns, and `eval/first_turn`; with an
    agent (`agents`, cfg.agent.entry), the fraction of its evaluation episodes solved, and `eval/reward`."""
    if not held_out:
        return {"eval/accuracy": float("nan")}
    if agents is not None:  # one greedy evaluation episode per example, through the run's endpoint
        result = await evaluate_agent(agents, held_out, reward, cfg.task.eval_reward or cfg.rewards[0].name)
        failures = EvalFailures(len(held_out))
        for failure in result["failures"]:
            failures.add(*failure)
        failures.report()
        return {"eval/accuracy": result["accuracy"], "eval/reward": result["reward"]}
    max_tokens = cfg.generator.sampling.get("max_tokens", 8)
    if cfg.env.name is not None:  # solved within env.max_turns, greedy
        renderer = TurnRenderer(tokenizer, **cfg.chat_template_kwargs)
        make_env = env_factory(cfg.env, cfg)
        result = await evaluate_env_summarised(generator, held_out, make_env, renderer, cfg.env, max_tokens)
        return {"eval/accuracy": result["accuracy"], "eval/first_turn": result["first_turn"]}
    result = await evaluate_task(generator, reward, held_out, eval_reward, max_tokens=max_tokens)
    return {"eval/accuracy": result["accuracy"]}


async def evaluate_env_summarised(
    generator, examples, make_env, renderer: TurnRenderer, env_cfg, max_tokens: int, concurrency=EVAL_TRAJECTORIES
) -> dict:
    """Greedy trajectories of the held-out examples with an environment. Returns {"accuracy": fraction solved
    within env.max_turns, "first_turn": fraction solved on the first turn, "reward": mean reward, "turns", "n",
    "failures": EvalFailures}. An example whose trajectory fails (the environment, the generator) counts as not
    solved, and its failure is reported with the others of its cause in one line."""
    if not examples:
        raise ValueError("evaluate_env_summarised: no held-out examples")
    slots, failed = asyncio.Semaphore(concurrency), {}

    async def one(i, example) -> Trajectory:
        async with slots:
            prompt_ids = renderer.tokenizer(example.text, add_special_tokens=False)["input_ids"]
            try:
                trajectories = await play_group(
                    example, prompt_ids, generator, make_env, renderer, env_cfg, 1, max_tokens, temperature=0.0
                )
                return trajectories[0]
            except SupervisionError:
                raise
            except Exception as e:  # an evaluation goes on: this example counts as not solved
                failed[i] = (example.id, drop_reason(e), f"{type(e).__name__}: {e}")
                return Trajectory(None, 0.0, False, 0)

    done = await asyncio.gather(*(one(i, e) for i, e in enumerate(examples)))
    failures = EvalFailures(len(examples))
    for i in sorted(failed):  # in the examples' order, whichever failed first
        failures.add(*failed[i])
    failures.report()
    return {**trajectory_scores(done), "failures": failures}
