"""On-policy distillation's config: GRPO's with a teacher. Torch-free, so that a config is read and checked in a
moment; the run is forge_rl/recipes/distill.py."""

from dataclasses import dataclass

from forge_rl.recipes.grpo_config import GRPOConfig


@dataclass
class DistillConfig(GRPOConfig):
    teacher: str = "???"  # "tiny-teacher" or a local HF model directory sharing the student's tokenizer
