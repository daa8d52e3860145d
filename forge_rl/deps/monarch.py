"""Monarch 0.7.0 names that `monarch.actor` and `monarch.job` do not export.

- `SupervisionError`: what a call raises when the callee's proc died. Monarch raises it to every caller but
  exports it only from its Rust bindings; forge_rl catches it to respawn replicas and to name a dead role.
- `ActorMesh`: the type `spawn` returns (annotations, and `isinstance` checks of what a service holds).
- `EndpointProperty`, `ConcurrentEndpointProperty`: what `@endpoint` / `@concurrent_endpoint` put on an actor
  class; a service tells endpoints from other attributes by them, and the reply ports call the function
  under one (`endpoint_function`); a call on each rank names the endpoint it was handed (`endpoint_name`).
- `in_batch_job()`: whether this process runs inside the sbatch job Monarch's batch mode submitted.
- `slurm_job_id(job)`: the id of the Slurm job a `SlurmJob` submitted or reattached to (no public accessor).
- `SLURM_JOB_READER`: the `SlurmJob` method that reads a job's state from squeue; forge_rl/launch/slurm.py
  overrides it to read Slurm 22.05 correctly.
"""

from collections.abc import Callable

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch._src.actor.actor_mesh import ActorMesh
from monarch._src.actor.concurrent import _ConcurrentEndpointProperty as ConcurrentEndpointProperty
from monarch._src.actor.endpoint import EndpointProperty

SLURM_JOB_READER = "_get_job_info_json"

__all__ = [
    "ActorMesh",
    "ConcurrentEndpointProperty",
    "EndpointProperty",
    "SLURM_JOB_READER",
    "SupervisionError",
    "endpoint_function",
    "endpoint_name",
    "in_batch_job",
    "slurm_job_id",
]


def endpoint_function(prop: EndpointProperty) -> Callable:
    """The actor method an endpoint property wraps (unwrapped from @concurrent_endpoint's wrapper)."""
    method = prop._method
    return method.__wrapped__ if isinstance(prop, ConcurrentEndpointProperty) else method


def endpoint_name(prop: EndpointProperty) -> str:
    """The name of the endpoint `Actor.method` refers to, as a mesh exposes it."""
    return endpoint_function(prop).__name__


def in_batch_job() -> bool:
    from monarch._src.job._batch_env import in_batch_job as _in_batch_job

    return _in_batch_job()


def slurm_job_id(job) -> str:
    """The Slurm job id of a SlurmJob: the one it reattached to (a cached running job), else the one its last
    `apply()` submitted."""
    return (job._running or job)._resolved_job_id()
