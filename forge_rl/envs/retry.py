"""Answer, and after a wrong answer try again: the simplest multi-turn task (e.g. addition with a retry)."""

from forge_rl.envs.base import Environment, EnvStep
from forge_rl.rewards.exact_match import exact_match


class RetryEnv(Environment):
    """The model answers the task's prompt; a wrong answer gets `feedback` as a user turn and another try,
    up to the rollout's env.max_turns. Solving on try k earns `credit[k]` (the last value repeats), so a first
    right answer is worth more than a corrected one; never solving earns 0."""

    def __init__(self, feedback: str = "Wrong. Try again.", credit: tuple[float, ...] = (1.0, 0.5)):
        if not credit:
            raise ValueError("RetryEnv: credit needs at least one value")
        self.feedback, self.credit = feedback, tuple(float(c) for c in credit)

    async def reset(self, example) -> None:
        if example.answer is None:
            raise ValueError(f"RetryEnv: {example.where} has no answer to check against (task.answer_column)")
        self.answer, self.tries = str(example.answer), 0

    async def step(self, reply: str) -> EnvStep:
        self.tries += 1
        if exact_match([""], [reply], answer=[self.answer])[0]:
            return EnvStep(reward=self.credit[min(self.tries, len(self.credit)) - 1], done=True, solved=True)
        return EnvStep(messages=[{"role": "user", "content": self.feedback}])
