"""GRPO: group-relative advantages over G samples of each prompt, the policy trained by the clipped loss family
(forge_rl/losses/grpo.py), asynchronous rollouts joined to training by the replay buffer.

    summary = await main(cfg)     # = train(RLRun(cfg, GRPO)): forge_rl/recipes/train.py, rl_run.py, rl_step.py

GRPO is the defaults of `Algorithm` (forge_rl/recipes/algorithm.py); PPO and distillation are values beside it.
"""

from forge_rl.recipes.algorithm import GRPO
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.rl_run import RLRun
from forge_rl.recipes.train import train

CONFIG = GRPOConfig  # what the command line and `forge_rl.launch submit --recipe grpo` read
ALGORITHM = GRPO


async def main(cfg: GRPOConfig) -> dict:
    return await train(RLRun(cfg, GRPO))
