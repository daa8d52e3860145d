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


def chat_prompt(tokenizer, problem: Problem) -> str:
    """The problem as a user turn, ready for the assistant's answer."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.question}], tokenize=False, add_generation_prompt=True
    )
