"""PPO with a critic: a value model trained beside the policy gives per-token advantages (GAE).

    python -m apps.ppo.main --config configs/ppo/tiny.yaml [key=value ...] [--verbose]

The run is GRPO's with a critic stage (forge_rl/recipes/ppo.py, docs/algorithms.md).
"""

from forge_rl.recipes.command_line import main_process
from forge_rl.recipes.ppo_config import PPOConfig


async def main(cfg: PPOConfig) -> dict:
    from forge_rl.recipes.train import train  # here: a config error is found before torch is imported
    from forge_rl.recipes.ppo import PPO
    from forge_rl.recipes.rl_run import RLRun

    return await train(RLRun(cfg, PPO))


if __name__ == "__main__":
    main_process(PPOConfig, main, __doc__.splitlines()[0])
