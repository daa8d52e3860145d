"""How actors come to exist: ForgeActor, Service (replicas, routing, health) and the provisioner."""

from forge_rl.controller.actor import ActorOptions, ForgeActor, stop_actor
from forge_rl.controller.provisioner import Provisioner, get_provisioner, new_session, provisioned, shutdown
from forge_rl.controller.service import Service

__all__ = [
    "ActorOptions",
    "ForgeActor",
    "Provisioner",
    "Service",
    "get_provisioner",
    "new_session",
    "provisioned",
    "shutdown",
    "stop_actor",
]
