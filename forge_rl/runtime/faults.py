"""Monarch's supervision events on the controller: a dead proc must not take the controller down.

Monarch's default for an unhandled failure exits the controller. `install_fault_hook()` (the provisioner
installs it when made, a service when it starts) replaces it: a failure of a service's replica is handed to
that service, which respawns it; any other failure is logged, and the failed actor's owner sees a
SupervisionError on its next call. A service names its replicas in `replica_owners` while they run
(forge_rl/runtime/service.py). A process lost while its actor starts is a `RoleStartFailed` naming the role.
"""

import logging
import re
from collections.abc import Iterable
from typing import Any

import monarch.actor

from forge_rl.deps.monarch import SupervisionError

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
        # not printed: the owner's next call fails, and the run ends in one line naming the role
        logger.info("unhandled Monarch failure: %s", failure)


def install_fault_hook() -> None:
    monarch.actor.unhandled_fault_hook = _forge_fault_hook


class RoleStartFailed(RuntimeError):
    """A role's process died, or stopped answering, while its actor was spawned or set up. Monarch's own error
    names only its internal setup actor, or a timeout; this one names the role (`role`) and why (`reason`)."""

    def __init__(self, role: str, reason: str):
        super().__init__(f"the {role} process died while it started ({reason})")
        self.role, self.reason = role, reason


def process_lost(error: BaseException) -> str | None:
    """Why a spawn or setup failed, when it failed because its process was lost rather than by an error raised in
    the actor's code (which Monarch carries in an ActorError, and stays the error it is)."""
    message = str(error).strip()
    if isinstance(error, SupervisionError):
        return why_lost(error)
    if isinstance(error, RuntimeError) and message.startswith("error spawning actor mesh"):
        timeout = re.search(r"Timeout\(([\d.]+)s\)", message)
        return f"no answer to its spawn in {float(timeout.group(1)):.0f} s" if timeout else "its spawn failed"
    return None


def why_lost(error: BaseException) -> str:
    """Why a role's process was lost, from the end of Monarch's message: "... the process this actor was running on
    failed: Killed(sig=9)", or its agent stopped answering before the death was seen ('timeout waiting for message
    from proc mesh agent while querying for "trainer-tnyrC3vdtwQ". The process likely crashed')."""
    message = str(error).strip()
    if not message:
        return "no reason given"
    if "querying for" in message:
        return "its process stopped answering; it likely crashed"
    return message.splitlines()[-1].rsplit("failed:", 1)[-1].strip()


def lost_role(error: BaseException, roles: Iterable[str] = ()) -> str | None:
    """Which role's process was lost, as Monarch's message names it: "<root>.<package.module.Class Class{...}>"
    failed, or (its agent stopped answering first) the actor mesh's lower-cased name and a suffix,
    'querying for "trainer-tnyrC3vdtwQ"'. `roles`, the run's role names, give a lower-cased one back its case.
    None when the message names no actor of the run's (Monarch's own setup actor)."""
    message = str(error)
    actor = re.search(r"<[\w.]*?\.(\w+) \1\{", message)
    queried = re.search(r'querying for "([\w-]+)-\w+"', message)
    name = actor.group(1) if actor else queried.group(1) if queried else None
    return next((r for r in roles if name and r.lower() == name.lower()), name)
