"""On-policy distillation: the student generates, a teacher scores every sampled token, the student learns
the teacher's distribution on its own samples.

It is the RL run with two changes (the `DISTILL` algorithm value below; docs/algorithms.md):
- a frozen teacher (a TorchTitan forward on its own actor, the `Reference` actor built from `teacher`) fills
  TrainBatch.ref_logprobs with log pi_teacher of every sampled token, every step;
- the loss's per-token advantage is distill_coef * (log pi_teacher - log pi_behaviour): minus the per-token
  reverse KL of the sampling student to the teacher, optionally plus reward_coef times the task reward's
  group advantage.
Everything else is GRPO's: async rollouts, the replay buffer and its staleness bound, weight sync without
draining, evaluation, checkpoints, Slurm.

Why a TorchTitan forward and not a vLLM engine with prompt logprobs: the trainer already holds the batch as
token tensors, the forward is the same code (and parallelism) as the student's, so teacher and student
logprobs share one numerical path (temperature included); a vLLM teacher would re-send every sequence as a
prompt and on CPU take cores from the student's generator (docs/benchmarks.md compares the demos' step rates).
"""

from forge_rl.config import ConfigError
from forge_rl.models import load_tokenizer, model_path
from forge_rl.recipes.algorithm import Algorithm
from forge_rl.recipes.rl_run import RLRun
from forge_rl.recipes.train import train
from forge_rl.recipes.distill_config import DistillConfig


def check_same_tokenizer(student: str, teacher: str) -> None:
    """Teacher logprobs are of token ids: both models must cut text into the same ids."""
    s, t = load_tokenizer(student, "model"), load_tokenizer(teacher, "teacher")
    if s.get_vocab() != t.get_vocab():
        only_s = len(set(s.get_vocab().items()) - set(t.get_vocab().items()))
        raise ConfigError(
            f"teacher={teacher!r} has another tokenizer than model={student!r} ({len(t)} tokens "
            f"against {len(s)}; {only_s} of the student's entries differ): on-policy distillation "
            "compares logprobs of the same token ids, so both must share one tokenizer"
        )


def teacher(cfg: DistillConfig) -> str:
    return model_path(cfg.teacher, "teacher", role="teacher")


def check(cfg: DistillConfig) -> None:
    """A teacher the student can learn from token by token, and a coefficient that lets it."""
    check_same_tokenizer(model_path(cfg.model), teacher(cfg))
    if cfg.trainer.loss.distill_coef <= 0:
        raise ConfigError(f"trainer.loss.distill_coef={cfg.trainer.loss.distill_coef}: distillation needs > 0")


DISTILL = Algorithm(
    "Distill",
    check=check,
    reference_model=teacher,  # the reference stage is the teacher
    # the teacher's part is per token, the reward's per group
    group_advantages=lambda cfg: cfg.trainer.loss.reward_coef > 0,
    zero_advantage_trains="every token carries the teacher's signal",
)
CONFIG = DistillConfig
ALGORITHM = DISTILL


async def main(cfg: DistillConfig) -> dict:
    return await train(RLRun(cfg, DISTILL))
