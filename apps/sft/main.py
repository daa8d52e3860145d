"""Supervised fine-tuning on the TorchTitan trainer, with greedy held-out evaluation through vLLM.

    python -m apps.sft.main --config configs/sft/tiny.yaml [key=value ...] [--verbose]

The run lives in the library (forge_rl/recipes/sft.py: `SFTRun` and `train`); this file only reads the
command line. Ctrl-C saves a checkpoint of the current step and exits with code 130.
"""

from forge_rl.recipes.command_line import main_process
from forge_rl.recipes.sft_config import SFTConfig


async def main(cfg: SFTConfig) -> dict:
    from forge_rl.recipes.sft import SFTRun, train  # here: a config error is found before torch is imported

    return await train(SFTRun(cfg))


if __name__ == "__main__":
    main_process(SFTConfig, main, __doc__.splitlines()[0])
