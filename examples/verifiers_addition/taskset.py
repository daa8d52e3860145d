"""The addition taskset: its rows (AdditionData), its scoring (AdditionTask.correct) and its splits."""

import random
import re
from typing import Literal

import verifiers.v1 as vf

TEST_SEED = 20261122  # the test pool's questions, the same for every run
INTEGER = re.compile(r"-?\d+")


class AdditionTasksetConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    size: int = 5000  # questions in the split (test: the first `size` of its pool)
    seed: int = 0  # which training questions (the test pool does not depend on it)
    max_operand: int = 99


class AdditionData(vf.TaskData):
    answer: str


def parse_answer(reply: str) -> str | None:
    """The reply's first integer: the parser of this task (a reply "57." or "57 is the sum" answers 57)."""
    match = INTEGER.search(reply or "")
    return match.group(0) if match else None


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        """1.0 when the last reply's first integer is the sum, else 0.0."""
        return float(parse_answer(trace.last_reply) == task.answer)

    @vf.metric
    async def parsed(self, task: AdditionData, trace: vf.Trace) -> float:
        """Whether the reply held an integer at all (a format signal beside the reward)."""
        return float(parse_answer(trace.last_reply) is not None)


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionTasksetConfig]):
    def load(self):
        cfg = self.config
        for i, (a, b) in enumerate(questions(cfg.split, cfg.size, cfg.seed, cfg.max_operand)):
            data = AdditionData(id=f"{cfg.split}-{i}", prompt=f"{a}+{b}=", answer=str(a + b))
            yield AdditionTask(data, cfg.task)


def questions(split: str, size: int, seed: int, max_operand: int) -> list[tuple[int, int]]:
    """`size` distinct test questions from the fixed pool, or `size` training questions none of which is in it."""
    pool_size = max(size, 500) if split == "test" else 500
    rng, pool = random.Random(TEST_SEED), {}
    while len(pool) < pool_size:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        pool.setdefault((a, b), None)
    if split == "test":
        return list(pool)[:size]
    rng, out = random.Random(seed), []
    while len(out) < size:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if (a, b) not in pool:
            out.append((a, b))
    return out
