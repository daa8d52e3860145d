"""GRPO, asynchronous: rollouts and training run concurrently, joined by the replay buffer.

    python -m apps.grpo.main --config configs/grpo/tiny.yaml [key=value ...] [--verbose]

The run lives in the library (forge_rl/recipes/rl_run.py: `RLRun`, whose steps a notebook can call one at a
time; forge_rl/recipes/train.py: `train`, the loop over them; forge_rl/recipes/rl_step.py: one step); this file
only reads the command line.
`async_mode: false` with `max_policy_age: 0` is the strictly synchronous baseline.
"""

from forge_rl.recipes.command_line import main_process
from forge_rl.recipes.grpo_config import GRPOConfig


async def main(cfg: GRPOConfig) -> dict:
    from forge_rl.recipes.rl_run import RLRun  # here: a config error is found before torch is imported
    from forge_rl.recipes.train import train

    return await train(RLRun(cfg))


if __name__ == "__main__":
    main_process(GRPOConfig, main, __doc__.splitlines()[0])
