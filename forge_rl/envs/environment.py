"""What a multi-turn environment is: `Environment` (one trajectory: reset, step, close) and the `EnvStep` each
step returns. forge_rl/envs/base.py says how they are played and named in config; this file holds only the two
types, so the environments' modules and the config's routing import them without importing each other."""

from dataclasses import dataclass, field
from typing import Any

EVAL_TRAJECTORIES = 64  # held-out trajectories played at once (forge_rl/loop/multiturn.py evaluate_env)


class EnvError(RuntimeError):
    """An environment broke its side of a trajectory; the rollout drops the group under `reason`."""

    reason = "env_error"


@dataclass
class EnvStep:
    messages: list[dict[str, str]] = field(default_factory=list)  # the environment's next turn (role, content)
    reward: float = 0.0  # added to the trajectory's reward
    done: bool = False
    solved: bool = False  # the task was solved (what held-out evaluation counts)
    # images the messages show (bytes, paths or PIL images), at their "<image>" markers, for a vision-language
    # model (forge_rl/loop/turn_images.py)
    images: list[Any] = field(default_factory=list)


class Environment:
    """One trajectory of a multi-turn task. Override `reset` and `step`."""

    @classmethod
    def chat_template_kwargs(cls, **args: Any) -> dict[str, Any]:
        """What the chat template gets when the task's prompts are rendered (e.g. `tools`, for a tool-using
        environment), given the environment's `env.args`."""
        return {}

    async def reset(self, example: Any) -> "list[dict[str, str]] | EnvStep | None":
        """Start on `example` (a forge_rl.data.task.TaskExample). None: the model answers the example's prompt;
        chat messages: the model answers these instead (every trajectory of a group must get the same ones); an
        EnvStep: its messages, showing its images (a vision-language model), in place of the example's."""

    async def step(self, reply: str) -> EnvStep:
        raise NotImplementedError(f"{type(self).__name__} must override Environment.step(reply) -> EnvStep")

    async def close(self) -> None:
        """Release what the trajectory held (a session, a thread); called once it ends, also on failure."""
