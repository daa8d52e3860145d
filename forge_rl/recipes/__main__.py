"""python -m forge_rl.recipes NAME --config FILE [key=value ...]: run recipe NAME (grpo, distill, sft)."""

import sys

from forge_rl.recipes import RECIPES, recipe
from forge_rl.recipes.command_line import main_process

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in RECIPES:
        raise SystemExit(f"usage: python -m forge_rl.recipes {{{','.join(RECIPES)}}} --config FILE [key=value ...]")
    module = recipe(sys.argv[1])
    main_process(module.CONFIG, module.main, (module.__doc__ or "").splitlines()[0], sys.argv[2:])
