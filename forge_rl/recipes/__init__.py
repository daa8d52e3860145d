"""The runs, one module per algorithm: each holds `CONFIG` (its config dataclass) and `main(cfg)` (the run from
start to summary). The RL run is an object whose steps can be called one at a time (forge_rl/recipes/rl_run.py);
GRPO, PPO and distillation are `Algorithm` values it runs; SFT's run is a sibling on the same actors and loop.

    python -m forge_rl.recipes grpo --config configs/grpo/tiny.yaml [key=value ...]

is what `apps/grpo/main.py` runs, and what a Slurm batch job runs inside its allocation."""

import importlib

RECIPES = ("grpo", "ppo", "distill", "sft")


def recipe(name: str):
    """The recipe module `name` (imported on demand: vLLM and TorchTitan are heavy)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}: one of {', '.join(RECIPES)}")
    return importlib.import_module(f"forge_rl.recipes.{name}")
