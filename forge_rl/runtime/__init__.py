"""The actor runtime: how actors come to exist and are reached (ForgeActor; Service: replicas, routing,
health), the provisioner (procs, devices, logs), placement (the cores and GPUs each role gets), reply ports
and the reaper."""

from forge_rl.runtime.actor import ForgeActor, stop_actor
from forge_rl.runtime.options import ActorOptions
from forge_rl.runtime.provisioner import Provisioner, get_provisioner, provisioned, shutdown
from forge_rl.runtime.service import Service

__all__ = [
    "ActorOptions",
    "ForgeActor",
    "Provisioner",
    "Service",
    "get_provisioner",
    "provisioned",
    "shutdown",
    "stop_actor",
]
