"""Every recipe's config is read without the heavy libraries: importing its config module (and forge_rl/config.py,
which reads it) imports none of torch, Monarch, vLLM, TorchTitan or transformers. A fresh interpreter, since this
one has imported them already."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "monarch", "vllm", "torchtitan", "transformers")
CONFIG_MODULES = (
    "forge_rl.recipes.run_config",
    "forge_rl.recipes.grpo_config",
    "forge_rl.recipes.ppo_config",
    "forge_rl.recipes.distill_config",
    "forge_rl.recipes.sft_config",
)


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_a_recipe_config_imports_nothing_heavy(module):
    code = f"import sys, forge_rl.config, {module}\nprint([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} imported {out.stdout.strip()}"


def test_every_recipe_config_loads_without_torch():
    """Loading a shipped config of each recipe, not only importing its module."""
    code = (
        "import sys\n"
        "from forge_rl.config import load_config\n"
        "from forge_rl.recipes.distill_config import DistillConfig\n"
        "from forge_rl.recipes.grpo_config import GRPOConfig\n"
        "from forge_rl.recipes.ppo_config import PPOConfig\n"
        "from forge_rl.recipes.sft_config import SFTConfig\n"
        "for schema, path in ((GRPOConfig, 'configs/grpo/tiny.yaml'), (PPOConfig, 'configs/ppo/tiny.yaml'),\n"
        "                     (DistillConfig, 'configs/distill/tiny.yaml'), (SFTConfig, 'configs/sft/tiny.yaml')):\n"
        "    load_config(schema, path)\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_recipes_spawn_the_roles_without_importing_what_the_roles_run():
    """The controller imports a recipe to spawn its roles, which import TorchTitan, vLLM and transformers in their
    own processes; each of those in the controller would add seconds to every run's start."""
    recipes = "forge_rl.recipes.grpo, forge_rl.recipes.ppo, forge_rl.recipes.distill, forge_rl.recipes.sft"
    code = f"import sys, {recipes}\nprint([m for m in ('torchtitan', 'vllm', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing the recipes imported {out.stdout.strip()}"
