"""Monarch's supervision events on the controller: a dead proc must not take the controller down.

Monarch's default for an unhandled failure exits the controller. `install_fault_hook()` (the provisioner
installs it when made, a service when it starts) replaces it: a failure of a service's replica is handed to
that service, which respawns it; any other failure is logged, and the failed actor's owner sees a
SupervisionError on its next call. A service names its replicas in `replica_owners` while they run
(forge_rl/runtime/service.py).
"""

import logging
from typing import Any

import monarch.actor

logger = logging.getLogger(__name__)

# A running replica's actor name (lowercased) -> its Service, which is told of the replica's failure on its
# own event loop (`_loop`, `_on_mesh_failure`).
replica_owners: dict[str, Any] = {}


def _forge_fault_hook(failure) -> None:
    """Replaces Monarch's default (exit the controller) for failures of service replicas.

    A replica's failure is handed to its service, which respawns it. Any other unhandled failure is
    logged; its owner sees a SupervisionError on the next call to the failed actor.
    """
    mesh_name = str(getattr(failure, "mesh_name", ""))
    # Monarch reports "<actor name, lowercased>-<uid>".
    actor_name = mesh_name.rsplit("-", 1)[0].lower()
    service = replica_owners.get(actor_name)
    if service is not None and service._loop is not None:
        service._loop.call_soon_threadsafe(service._on_mesh_failure, actor_name)
    elif not mesh_name.startswith("logger-"):  # Monarch's per-proc log forwarder dies with its proc
        logger.error("unhandled Monarch failure: %s", failure)


def install_fault_hook() -> None:
    monarch.actor.unhandled_fault_hook = _forge_fault_hook
