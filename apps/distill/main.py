"""On-policy distillation: the student generates, a teacher scores every sampled token, the student learns
the teacher's distribution on its own samples.

    python -m apps.distill.main --config configs/distill/tiny.yaml [key=value ...] [--verbose]

The run is GRPO's with the teacher as its reference stage (forge_rl/recipes/distill.py, docs/algorithms.md).
"""

from forge_rl.recipes.command_line import main_process
from forge_rl.recipes.distill_config import DistillConfig


async def main(cfg: DistillConfig) -> dict:
    from forge_rl.recipes.distill import DISTILL  # here: a config error is found before torch is imported
    from forge_rl.recipes.rl_run import RLRun
    from forge_rl.recipes.train import train

    return await train(RLRun(cfg, DISTILL))


if __name__ == "__main__":
    main_process(DistillConfig, main, __doc__.splitlines()[0])
