"""The actor runtime: how actors come to exist and are reached (ForgeActor; Service: replicas, routing,
health), the provisioner (procs, devices, logs), placement (the cores and GPUs each role gets), reply ports
and the reaper.

The names below are imported on first use, so that a config module of this package (placement.py's
ResourcesConfig, timeouts.py's TimeoutsConfig) is read without importing torch or Monarch."""

import importlib

_HOMES = {
    "ActorOptions": "forge_rl.runtime.options",
    "ForgeActor": "forge_rl.runtime.actor",
    "Provisioner": "forge_rl.runtime.provisioner",
    "Service": "forge_rl.runtime.service",
    "get_provisioner": "forge_rl.runtime.provisioner",
    "provisioned": "forge_rl.runtime.provisioner",
    "shutdown": "forge_rl.runtime.provisioner",
    "stop_actor": "forge_rl.runtime.actor",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
