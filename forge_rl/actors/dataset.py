"""Dataset actor: hands out prompts in a fixed order, and remembers where it is for resume."""

import itertools

from monarch.actor import endpoint

from forge_rl.controller import ForgeActor
from forge_rl.data.arithmetic import Problem, iter_training_problems


class ArithmeticDataset(ForgeActor):
    """An endless stream of generated addition problems, held-out questions excluded, fixed by the seed."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.position = 0
        self._stream = iter_training_problems(seed)

    @endpoint
    async def next(self) -> Problem:
        self.position += 1
        return next(self._stream)

    @endpoint
    async def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    @endpoint
    async def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"dataset state is for seed {state['seed']}, this run uses seed {self.seed}")
        self._stream = itertools.islice(iter_training_problems(self.seed), state["position"], None)
        self.position = int(state["position"])
