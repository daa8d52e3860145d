"""2-digit addition with feedback, as an OpenEnv environment: written against openenv's API alone.

The model gets "a+b="; a right answer ends the episode with reward 1.0 on the first try and 0.5 on the second; a
wrong one gets "Wrong. Try again." until `max_tries` are used (reward 0). The same game as forge_rl's RetryEnv
(`make demo-multiturn`), so their learning compares.

    env = AdditionEnvironment()
    obs = env.reset(seed=7)                       # obs.message == "a+b=", drawn from the seed
    obs = env.reset(question="12+34=")            # or the task's own question
    obs = env.step(AdditionAction(answer="46"))   # obs.reward == 1.0, obs.done

Served by OpenEnv's own app (examples/openenv_addition/app.py), or by a forge_rl run (env.openenv.serve: true).
"""

import random
import re
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State

QUESTION = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=\s*$")


class AdditionAction(Action):
    answer: str  # the model's reply


class AdditionObservation(Observation):
    message: str = ""  # the question, then the feedback


class AdditionEnvironment(Environment):
    """One episode: a question, up to `max_tries` answers."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance and nothing is shared

    def __init__(self, max_tries: int = 2, credit: tuple[float, ...] = (1.0, 0.5), feedback: str = "Wrong. Try again."):
        super().__init__()
        self.max_tries, self.credit, self.feedback = max_tries, tuple(credit), feedback
        self._state = State(episode_id=None, step_count=0)
        self.answer = ""

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, question: str | None = None
    ) -> AdditionObservation:
        if question is None:
            rng = random.Random(seed)
            question = f"{rng.randint(0, 99)}+{rng.randint(0, 99)}="
        match = QUESTION.match(question)
        if match is None:
            raise ValueError(f"question {question!r} is not 'a+b='")
        self.answer = str(int(match[1]) + int(match[2]))
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return AdditionObservation(message=question.strip(), reward=None, done=False)

    def step(self, action: AdditionAction, timeout_s: float | None = None, **_: Any) -> AdditionObservation:
        self._state.step_count += 1
        tries = self._state.step_count
        if action.answer.strip() == self.answer:
            return AdditionObservation(reward=self.credit[min(tries, len(self.credit)) - 1], done=True)
        if tries >= self.max_tries:
            return AdditionObservation(reward=0.0, done=True)
        return AdditionObservation(message=self.feedback, reward=0.0, done=False)

    @property
    def state(self) -> State:
        return self._state
