"""The RL step in four hops, as docs/design.md draws them: main -> train -> rl_step -> Trainer.step ->
optimizer.step(). Each hop is a call written in the function before it, so a reader follows the loop from the
command line to the optimizer step in four jumps; a refactor that puts a layer in between fails here."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _function(path: str, name: str, cls: str | None = None) -> ast.AST:
    tree = ast.parse((REPO / path).read_text())
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def _calls(node: ast.AST) -> set[str]:
    """Every call in `node`, as the dotted text of what is called (`self.optimizer.step`, `rank.step.call_one`)."""
    return {ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}


def test_main_to_the_optimizer_step_is_four_hops():
    assert "train" in _calls(_function("apps/grpo/main.py", "main"))
    assert "algorithm.step" in _calls(_function("forge_rl/recipes/train.py", "train"))  # = rl_step for RL
    assert "rank.step.call_one" in _calls(_function("forge_rl/recipes/rl_step.py", "rl_step"))  # Trainer.step
    trainer_step = _calls(_function("forge_rl/actors/trainer.py", "step", cls="Trainer"))
    assert {"self.optimizer.step", "self.weights.publish"} <= trainer_step


def test_the_rl_algorithms_step_with_rl_step():
    from forge_rl.recipes.algorithm import GRPO
    from forge_rl.recipes.distill import DISTILL
    from forge_rl.recipes.ppo import PPO
    from forge_rl.recipes.rl_step import rl_step
    from forge_rl.recipes.sft import SFT
    from forge_rl.recipes.sft_step import sft_step

    assert GRPO.step is PPO.step is DISTILL.step is rl_step and SFT.step is sft_step
