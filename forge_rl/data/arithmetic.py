"""A synthetic task generated in code: "a+b=" -> "c", posed as a chat turn.

Deterministic given a seed, so train and held-out splits never change between runs.
"""

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    id: str
    question: str  # "12+34="
    answer: str  # "46"


def problems(n: int, seed: int, max_operand: int = 99) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append(Problem(id=f"add-{seed}-{i}", question=f"{a}+{b}=", answer=str(a + b)))
    return out


def chat_prompt(tokenizer, problem: Problem, **chat_template_kwargs) -> str:
    """The problem as a user turn, ready for the assistant's answer. `chat_template_kwargs` go to the
    template (Qwen3's `enable_thinking=False` turns off its default thinking block)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.question}],
        tokenize=False,
        add_generation_prompt=True,
        **chat_template_kwargs,
    )


# ---- splits ------------------------------------------------------------------------------------------
# The held-out set is a fixed pool of distinct questions drawn with its own seed; training streams skip
# every question in that pool, so no held-out question is ever trained on (for any training seed).

HELD_OUT_SEED = 20261122
HELD_OUT_POOL = 500  # size of the pool that training excludes; held_out_problems(n) is its first n


def held_out_problems(n: int = 500, max_operand: int = 99) -> list[Problem]:
    """The first `n` of a fixed pool of distinct held-out questions (same for every run and seed)."""
    if not 0 < n <= HELD_OUT_POOL:
        raise ValueError(f"held_out_problems: n must be in [1, {HELD_OUT_POOL}] (the held-out pool), got {n}")
    rng = random.Random(HELD_OUT_SEED)
    seen: dict[str, Problem] = {}
    while len(seen) < HELD_OUT_POOL:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        q = f"{a}+{b}="
        if q not in seen:
            seen[q] = Problem(id=f"heldout-{len(seen)}", question=q, answer=str(a + b))
    return list(seen.values())[:n]


def held_out_questions(max_operand: int = 99) -> frozenset[str]:
    return frozenset(p.question for p in held_out_problems(HELD_OUT_POOL, max_operand))


def iter_training_problems(seed: int, max_operand: int = 99):
    """An endless, deterministic stream of training problems that never contains a held-out question.
    Prefix-stable: the first k problems do not depend on how many are taken."""
    excluded = held_out_questions(max_operand)
    rng = random.Random(seed)
    i = 0
    while True:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        q = f"{a}+{b}="
        if q in excluded:
            continue
        yield Problem(id=f"train-{seed}-{i}", question=q, answer=str(a + b))
        i += 1


def training_problems(n: int, seed: int, max_operand: int = 99) -> list[Problem]:
    """The first `n` problems of `iter_training_problems(seed)` (held-out questions excluded)."""
    import itertools

    return list(itertools.islice(iter_training_problems(seed, max_operand), n))


# ---- as a task (task.source: arithmetic) ------------------------------------------------------------------


def training_rows(seed: int = 0):
    """The training stream as task rows: {"id", "prompt", "answer"}, endless."""
    for p in iter_training_problems(seed):
        yield {"id": p.id, "prompt": p.question, "answer": p.answer}


def held_out_rows() -> list[dict]:
    """The whole held-out pool as task rows (an app's eval_size takes its first n)."""
    return [{"id": p.id, "prompt": p.question, "answer": p.answer} for p in held_out_problems(HELD_OUT_POOL)]
