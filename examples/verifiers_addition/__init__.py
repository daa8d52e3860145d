"""Two-digit addition as a verifiers taskset, written only against `verifiers` (nothing here imports forge_rl):
"a+b=" as the user turn, the reply parsed for its first integer, and one reward, `correct`. The `test` split is a
fixed pool of questions that the `train` split never asks. forge_rl trains on it through its agent endpoint with

    python -m apps.grpo.main --config configs/grpo/tiny_verifiers.yaml

which names it by its import path (agent.verifiers.env: examples.verifiers_addition; docs/agents.md, "verifiers
environments"). Installed as a package of its own, verifiers' tools would name it by that package's name.
"""

from examples.verifiers_addition.taskset import AdditionData, AdditionTask, AdditionTaskset, AdditionTasksetConfig

__all__ = ["AdditionTaskset"]
_ = (AdditionData, AdditionTask, AdditionTasksetConfig)  # re-exported for code that builds tasks by hand
