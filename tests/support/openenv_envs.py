"""OpenEnv environments for the tests of env.openenv (tests/integration/test_openenv_adapter.py and
tests/integration/test_openenv.py): the example's addition game recording what it was given, and environments that
break in each way a user's can.
Each is a real openenv Environment, named by "tests.support.openenv_envs:Class" as a config would."""

import math
import threading
import time
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import Action, MCPEnvironment, Observation, State

from examples.openenv_addition.env import AdditionAction, AdditionEnvironment, AdditionObservation


class RecordedAddition(AdditionEnvironment):
    """The example's game, recording every reset's seed and question and every close (class-wide)."""

    resets: list[tuple[int | None, str | None]] = []
    closed = 0
    lock = threading.Lock()

    def reset(self, seed=None, episode_id=None, question=None) -> AdditionObservation:
        with self.lock:
            RecordedAddition.resets.append((seed, question))
        return super().reset(seed=seed, episode_id=episode_id, question=question)

    def close(self) -> None:
        with self.lock:
            RecordedAddition.closed += 1


class RaisesInReset(AdditionEnvironment):
    def reset(self, seed=None, episode_id=None, **kw) -> AdditionObservation:
        raise KeyError("the reset's own bug")


class RaisesInStep(AdditionEnvironment):
    def step(self, action: AdditionAction, timeout_s=None, **kw) -> AdditionObservation:
        raise KeyError("the step's own bug")


class HangsInStep(AdditionEnvironment):
    def step(self, action: AdditionAction, timeout_s=None, **kw) -> AdditionObservation:
        time.sleep(3600)
        raise AssertionError("unreachable")


class NaNReward(AdditionEnvironment):
    def step(self, action: AdditionAction, timeout_s=None, **kw) -> AdditionObservation:
        return AdditionObservation(reward=math.nan, done=True)


class TextObservation(Observation):
    message: str = ""
    reward: Any = None  # a user's observation that lets any reward through


class TextReward(AdditionEnvironment):
    def step(self, action: AdditionAction, timeout_s=None, **kw) -> TextObservation:
        return TextObservation(reward="high", done=True)


class NumberAction(Action):
    number: int


class NumberAddition(AdditionEnvironment):
    """Takes its answer as an integer: a reply that is not one is refused by the Action."""

    def step(self, action: NumberAction, timeout_s=None, **kw) -> AdditionObservation:
        return super().step(AdditionAction(answer=str(action.number)))


class NotConcurrent(AdditionEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = False  # OpenEnv's server refuses more than one session of it


class NotAnEnvironment:
    def reset(self, seed=None):
        return None

    def step(self, action):
        return None


class AnswerAction(Action):
    answer: str


class CalculatorEnv(MCPEnvironment):
    """An MCP environment: an `add` tool, then an answer (reward 1.0 when it is 5555)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calculator")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kw) -> AdditionObservation:
        return AdditionObservation(message="What is 1234+4321? Use the add tool.")

    def _step_impl(self, action: AnswerAction, timeout_s=None, **kw) -> AdditionObservation:
        return AdditionObservation(reward=float(action.answer.strip() == "5555"), done=True)

    @property
    def state(self) -> State:
        return self._state
