"""One entry of a run's `rewards:` list: a reward function, or a learned reward model with its settings. The
reward actor that runs them is forge_rl/actors/reward.py; this module imports nothing heavy, so that a config is
read without torch or Monarch."""

from dataclasses import dataclass, field
from typing import Any


KINDS = ("classifier", "judge")
DEFAULT_JUDGE_TEMPLATE = (
    "Question: {prompt}\nAnswer: {completion}\nIs the answer correct? Reply with a score from 0 to 10.\nScore:"
)


@dataclass
class RewardConfig:
    """A reward function (`name`), or a learned reward model (`model`) on procs of its own
    (forge_rl/actors/reward_model.py)."""

    name: str = ""  # a key of REWARDS, or "package.module:function"; a model reward's name (default: its dir's)
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments (e.g. a sandbox's limits)
    model: str | None = None  # a reward model: an HF checkpoint directory (or an embedded model's name)
    kind: str = "classifier"  # classifier (an HF sequence classifier) | judge (an LLM through vLLM)
    max_batch: int = 64  # classifier: sequences per forward
    batch_window_ms: float = 10.0  # classifier: how long a forward waits for more groups to batch with
    template: str = DEFAULT_JUDGE_TEMPLATE  # judge: the user turn, with {prompt} and {completion}
    parser: str = r"(-?\d+(?:\.\d+)?)"  # judge: a regex whose first group is the number, or "package.module:function"
    scale: float = 0.1  # judge: the reward is the parsed number times this (0-10 -> 0-1)
    max_tokens: int = 16  # judge: the verdict's length
    max_concurrency: int = 32  # groups in flight to the model at once; more wait (within reward_timeout_s)
    engine_args: dict[str, Any] = field(default_factory=dict)  # judge: its vLLM engine's (tensor_parallel_size 1
    # unless set; never the policy generator's)

    def __post_init__(self) -> None:
        if self.model is None and not self.name:
            raise ValueError("rewards: each entry needs a name (a reward function) or a model (a reward model)")
        if self.model is not None:  # its kind is checked with its other settings, naming rewards[i].kind
            # (forge_rl/actors/reward.py reward_model_errors, from the run's checks; the reward actor refuses it too)
            self.name = self.name or f"{self.kind}:{self.model.rstrip('/').rsplit('/', 1)[-1]}"
