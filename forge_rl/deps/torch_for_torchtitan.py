"""What TorchTitan 0.3.0 imports from a newer torch than a site may have, and forge_rl never uses.

TorchTitan 0.3.0's FSDP module (torchtitan/distributed/fsdp.py, which its Qwen3 imports) takes
`torch.distributed.fsdp.DataParallelMeshDims` at import time, a torch 2.12 name, for its "full_dtensor" meshes.
forge_rl's trainer builds "partial_dtensor" meshes and never passes one, so on torch 2.11 (a cluster's site PyTorch,
docs/getting_started.md) TorchTitan is given a placeholder under that name: its imports and annotations work, and
constructing one raises, naming the torch it needs. Where torch has the name, nothing is changed.
`forge_rl/deps/torchtitan.py` calls `provide()` before importing anything of TorchTitan.
"""

import importlib

import torch

# {torch module: [names TorchTitan 0.3.0 imports from it that older torches lack]}
NEEDED = {"torch.distributed.fsdp": ["DataParallelMeshDims"]}
SINCE = "2.12"  # the torch release that has them all


def missing() -> list[str]:
    """The names TorchTitan imports that this torch lacks, as 'module.Name' (imports nothing of TorchTitan)."""
    return [
        f"{module}.{name}"
        for module, names in NEEDED.items()
        for name in names
        if not hasattr(importlib.import_module(module), name)
    ]


def placeholder(qualified: str) -> type:
    """A class that stands for `qualified` in annotations and `import` lines and refuses to be constructed."""

    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"{qualified} is a placeholder forge_rl gave TorchTitan: torch {torch.__version__} has no such name "
            f"(torch {SINCE} or later has it). forge_rl's trainer never uses it; a TorchTitan feature that does "
            f"(its full_dtensor meshes) needs torch {SINCE}+"
        )

    module, name = qualified.rsplit(".", 1)
    return type(
        name, (), {"__init__": refuse, "__module__": module, "__doc__": refuse.__doc__, "forge_rl_placeholder": True}
    )


def provide() -> list[str]:
    """Give each missing name a placeholder; returns those given (none on torch 2.12 and later)."""
    given = missing()
    for qualified in given:
        module, name = qualified.rsplit(".", 1)
        setattr(importlib.import_module(module), name, placeholder(qualified))
    return given
