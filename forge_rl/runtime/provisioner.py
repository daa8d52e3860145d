"""The provisioner: where proc meshes come from, and the one place that stops them all.

Every actor and service in a run gets its proc mesh here: on this host, or on a host mesh the launcher made
for its role (`hosts={"trainer": HostMesh, ...}`, from a Slurm allocation). On CUDA hosts the provisioner hands out
GPUs per proc -- exactly the ids the placement plan chose (`gpu_ids`), or else the next free ones -- and pins them
with CUDA_VISIBLE_DEVICES in the proc's bootstrap, before anything in the proc can initialise CUDA. For meshes that
run torch.distributed (the trainer), it sets up the
torch elastic environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) with monarch.spmd.

`shutdown()` stops every mesh it made and removes the run's shared-memory files
(/dev/shm/forge_rl-<run_id>-*). Use `async with provisioned():` (a run's `start()`/`stop()` do) so
that this also happens when the controller exits through an exception or Ctrl-C.
"""

import asyncio
import atexit
import contextlib
import gc
import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from monarch.actor import ProcMesh, this_host

from forge_rl.runtime.faults import install_fault_hook
from forge_rl.runtime.reaper import CONTROLLER_ENV, reap_descendants_on_exit
from forge_rl.weights.runs import RUN_ID_ENV, cleanup_stale_runs, register_process, remove_run, run_prefix

logger = logging.getLogger(__name__)


def visible_gpus() -> list[str]:
    """GPU ids this controller may hand out, without initialising CUDA in the controller."""
    if (env := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [g for g in env.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


# Shared-memory files of a run are named /dev/shm/forge_rl-<run_id>-*; the weight store owns that naming.
shm_prefix = run_prefix


def _bootstrap(
    mesh_name: str,
    procs: int,
    procs_per_host: int,
    gpu_ids: list[str],
    gpus_per_proc: int,
    cpus: list[list[int]],
    threads: int,
    log_dir: str | None,
    run_id: str,
):
    """Bootstrap for a proc: a name that says its role, its output in a log file of its own (when the run has
    a log_dir), only its own GPUs, its own cores with its own number of threads. Runs in the proc before user
    code touches CUDA or starts a thread pool."""

    def bootstrap() -> None:
        from monarch.actor import current_rank

        rank = current_rank().rank
        local = rank % procs_per_host  # GPUs and cores are per host
        # When the mesh stops, the interpreter's last garbage collection would walk every object torch and vLLM
        # made (seconds per proc on a small CPU) though nothing there needs finalizing: skip the walk.
        atexit.register(gc.freeze)
        # Procs on other hosts are started by that host's worker, not by this controller: they inherit nothing.
        os.environ[RUN_ID_ENV] = run_id
        if log_dir:
            # Everything this proc and its children (vLLM's engine processes) write to stdout/stderr goes to
            # the file: the controller's console keeps the run's progress, and a dead proc's last words stay.
            name = mesh_name if procs == 1 else f"{mesh_name}-{rank}"
            fd = os.open(Path(log_dir) / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        # `ps`, `top` and psutil show "forge:Trainer" instead of one more "python" (15 characters at most).
        with contextlib.suppress(OSError):
            Path(f"/proc/self/task/{os.getpid()}/comm").write_text(f"forge:{mesh_name}"[:15])
        if gpus_per_proc:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids[local * gpus_per_proc : (local + 1) * gpus_per_proc])
        if cpus:
            mine = cpus[local]
            # Affinity is per thread, and Monarch's runtime threads exist already: pin every one of them
            # (threads started later inherit the mask of the thread that starts them).
            for tid in os.listdir("/proc/self/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(tid), mine)
            n = str(threads or len(mine))
            os.environ["OMP_NUM_THREADS"] = n
            # A vLLM CPU engine started in this proc binds its OpenMP threads to these cores (and its
            # processes inherit the affinity), instead of choosing cores across the whole machine.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
            import torch

            torch.set_num_threads(int(n))

    return bootstrap


_run_ids_made_here: set[str] = set()  # every run id a provisioner of this process has used


class Provisioner:
    def __init__(self, run_id: str | None = None, log_dir: str | Path | None = None, hosts: dict | None = None):
        # log_dir: each proc's stdout/stderr (and its children's) go to log_dir/<mesh>.log; None keeps them on
        # the controller's console. hosts: the launcher's host meshes by role (none: everything on this host).
        self.hosts = dict(hosts or {})
        self.log_dir = Path(log_dir) if log_dir else None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        # A run id in the environment names this run, unless another controller set it (this process was
        # started by one: a test, a notebook, a sweep, and its run is not ours) or an earlier run of this process
        # did: runs one after another in one process (a notebook, a test module) each get their own shared
        # memory, so whatever the last one left can never be taken for this one's.
        started_by_another = os.environ.get(CONTROLLER_ENV, "").split("-")[0] not in ("", str(os.getpid()))
        given = None if started_by_another else os.environ.get(RUN_ID_ENV)
        self.run_id = run_id or (given if given not in _run_ids_made_here else None) or uuid.uuid4().hex[:8]
        _run_ids_made_here.add(self.run_id)
        os.environ[RUN_ID_ENV] = self.run_id  # procs inherit it (shm names, logs)
        # Shared memory outlives killed runs: remove what dead runs left, and mark this one alive.
        cleanup_stale_runs()
        register_process(self.run_id)
        # A SIGKILLed controller runs no cleanup: a watcher in its own session then stops every process the
        # run started (procs, vLLM engine cores) and removes the run's shared memory.
        self._reaper = reap_descendants_on_exit(run_id=self.run_id)
        self._meshes: list[ProcMesh] = []
        self.mesh_names: set[str] = set()  # every mesh's name as given (Monarch's errors may lower-case it)
        self._services: list = []
        self._visible_gpus = visible_gpus()
        self._free_gpus = list(self._visible_gpus)
        self._gpus_of: dict[int, list[str]] = {}
        self._stopped = False
        # A dead proc must not take the controller down (Monarch's default): services respawn their
        # replicas, and any other actor's owner gets a SupervisionError on its next call.
        install_fault_hook()

    async def get_proc_mesh(
        self,
        procs: int = 1,
        gpus: int = 0,
        mesh_name: str = "forge",
        spmd: bool = False,
        cpus: list[list[int]] | None = None,
        threads: int = 0,
        share_gpus: bool = False,
        host_mesh: str | None = None,
        host_index: int | None = None,
        gpu_ids: list[str] | None = None,
    ) -> ProcMesh:
        """A new mesh of `procs` procs on this host, each with `gpus` GPUs of its own (True = 1).

        `cpus`: each proc's cores (one list per proc), with `threads` torch/OpenMP threads (0 = one per
        core). `gpu_ids`: exactly these GPUs (the placement plan's: `gpus` per proc, in proc order); without
        them the next free ones. `share_gpus`: do not reserve them (without `gpu_ids`: the first visible), for
        roles that time-share a device (colocated placement). `host_mesh`: the launcher's host mesh of that name
        instead (procs spread evenly over its hosts; GPUs numbered per host, `gpu_ids` unused), or with
        `host_index` one host of it (a service's replica)."""
        if host_mesh in self.hosts:
            return await self._remote_proc_mesh(
                self.hosts[host_mesh], host_mesh, procs, int(gpus), mesh_name, spmd, host_index
            )
        if self._stopped:
            raise RuntimeError("provisioner was shut down; create a new one")
        if procs < 1:
            raise ValueError(f"procs must be >= 1, got {procs}")
        if cpus and len(cpus) != procs:
            raise ValueError(f"mesh {mesh_name!r}: {len(cpus)} core lists for {procs} procs")
        gpu_ids, reserved = self._take_gpus(mesh_name, procs, int(gpus), gpu_ids, share_gpus)
        bootstrap = _bootstrap(
            mesh_name,
            procs,
            procs,
            gpu_ids,
            int(gpus),
            list(cpus or []),
            threads,
            str(self.log_dir) if self.log_dir else None,
            self.run_id,
        )
        try:
            mesh = this_host().spawn_procs(per_host={"procs": procs}, bootstrap=bootstrap, name=mesh_name)
            await mesh.initialized
        except BaseException:
            self._free_gpus.extend(reserved)
            raise
        self._gpus_of[id(mesh)] = reserved
        self._meshes.append(mesh)
        self.mesh_names.add(mesh_name)
        if spmd:
            from monarch.spmd import setup_torch_elastic_env_async

            await setup_torch_elastic_env_async(mesh)
        return mesh

    def _take_gpus(
        self, mesh_name: str, procs: int, gpus: int, gpu_ids: list[str] | None, share: bool
    ) -> tuple[list[str], list[str]]:
        """The GPU ids of a new mesh's procs (`gpus` each, in proc order), and those it reserves until it stops."""
        wanted = procs * gpus
        if not gpus:
            return [], []
        if gpu_ids:
            if len(gpu_ids) != wanted or len(set(gpu_ids)) != wanted:
                raise ValueError(
                    f"mesh {mesh_name!r}: GPU ids {gpu_ids} for {procs} procs x {gpus} GPUs ({wanted} distinct)"
                )
            if unknown := [g for g in gpu_ids if g not in self._visible_gpus]:
                raise RuntimeError(
                    f"mesh {mesh_name!r} asks for GPUs {unknown}, not among the visible {self._visible_gpus or 'none'}"
                )
            if share:
                return list(gpu_ids), []
            if taken := [g for g in gpu_ids if g not in self._free_gpus]:
                raise RuntimeError(f"mesh {mesh_name!r} asks for GPUs {gpu_ids}; {taken} are another mesh's")
            self._free_gpus = [g for g in self._free_gpus if g not in gpu_ids]
            return list(gpu_ids), list(gpu_ids)
        if share:
            return self._visible_gpus[:wanted], []
        if len(self._free_gpus) < wanted:
            raise RuntimeError(
                f"mesh {mesh_name!r} asks for {wanted} GPUs ({procs} procs x {gpus}); "
                f"{len(self._free_gpus)} free of the visible {self._visible_gpus or 'none'}"
            )
        ids, self._free_gpus = self._free_gpus[:wanted], self._free_gpus[wanted:]
        return ids, ids

    async def _remote_proc_mesh(
        self, hosts, role: str, procs: int, gpus: int, mesh_name: str, spmd: bool, host_index: int | None
    ) -> ProcMesh:
        """Procs on the launcher's hosts for `role`: each host's GPUs are its own (0..n-1 there); cores are not
        pinned (the role has those hosts to itself)."""
        if self._stopped:
            raise RuntimeError("provisioner was shut down; create a new one")
        label, n_hosts = next(iter(hosts.sizes.items()))
        first_gpu = 0
        if host_index is not None:
            # A service's replica: one host, round-robin; the k-th replica on a host takes the k-th set of its GPUs
            # (the same set again when it is respawned).
            host, slot = host_index % n_hosts, host_index // n_hosts
            hosts, n_hosts, first_gpu = hosts.slice(**{label: slice(host, host + 1)}), 1, slot * procs * gpus
        if procs % n_hosts:
            raise ValueError(f"mesh {mesh_name!r}: {procs} procs do not spread evenly over the {n_hosts} {role} hosts")
        per_host = procs // n_hosts
        gpu_ids = [str(first_gpu + i) for i in range(per_host * gpus)]
        bootstrap = _bootstrap(
            mesh_name, procs, per_host, gpu_ids, gpus, [], 0, str(self.log_dir) if self.log_dir else None, self.run_id
        )
        mesh = hosts.spawn_procs(per_host={"procs": per_host}, bootstrap=bootstrap, name=mesh_name)
        await mesh.initialized
        self._meshes.append(mesh)
        self.mesh_names.add(mesh_name)
        if spmd:
            from monarch.spmd import setup_torch_elastic_env_async

            await setup_torch_elastic_env_async(mesh)
        return mesh

    async def stop_proc_mesh(self, mesh: ProcMesh) -> None:
        if mesh not in self._meshes:
            return  # stopped already, or being stopped by another task
        self._meshes.remove(mesh)
        self._free_gpus.extend(self._gpus_of.pop(id(mesh), []))
        with contextlib.suppress(Exception):  # a mesh whose procs died cannot be stopped cleanly
            await asyncio.wait_for(mesh.stop(), timeout=30)

    def register_service(self, service) -> None:
        self._services.append(service)

    async def shutdown(self) -> None:
        """Stop every service and mesh of this run and remove its shared-memory files."""
        if self._stopped:
            return
        self._stopped = True
        # Everything stops side by side (a vLLM engine takes seconds to stop; the other meshes need not wait).
        # A service stops its own replicas' meshes, so it gets to them first: no replica is respawned meanwhile.
        stopping = [asyncio.ensure_future(service.shutdown()) for service in self._services]
        await asyncio.sleep(0)  # each service marks itself closed and takes its replicas' meshes
        stopping += [asyncio.ensure_future(self.stop_proc_mesh(mesh)) for mesh in list(self._meshes)]
        await asyncio.gather(*stopping, return_exceptions=True)
        remove_run(self.run_id)
        self._reaper.terminate()  # nothing left to watch (a notebook's controller lives on after a run)
        self._reaper.wait()


_provisioner: Provisioner | None = None


def get_provisioner() -> Provisioner:
    """The run's provisioner, created on first use."""
    global _provisioner
    if _provisioner is None or _provisioner._stopped:
        _provisioner = Provisioner()
    return _provisioner


def running_provisioner() -> Provisioner | None:
    """The current run's provisioner, or None when no run is up; unlike `get_provisioner()`, it starts none."""
    return _provisioner if _provisioner is not None and not _provisioner._stopped else None


async def stop_proc_mesh(mesh: ProcMesh) -> None:
    """Stop a proc mesh of the current run. Starts no provisioner: this is called while a run shuts down (its
    services stop their replicas) and after (an actor stopped late), when `get_provisioner()` would start a new run
    whose watcher then lives as long as this process."""
    if _provisioner is not None:
        await _provisioner.stop_proc_mesh(mesh)


async def shutdown() -> None:
    """Stop everything the current run started (idempotent)."""
    global _provisioner
    if _provisioner is not None:
        await _provisioner.shutdown()
        _provisioner = None


@contextlib.asynccontextmanager
async def provisioned(run_id: str | None = None, log_dir: str | Path | None = None, hosts: dict | None = None):
    """`async with provisioned() as prov:` -- everything spawned inside is stopped on the way out,
    whether the block returns, raises, or is cancelled by Ctrl-C. With `log_dir`, each proc's output goes to
    a file there instead of the console; with `hosts` (the launcher's host meshes by role), roles that name one
    run there."""
    global _provisioner
    if _provisioner is not None and not _provisioner._stopped:
        raise RuntimeError("a provisioner is already active; nest work inside it instead")
    _provisioner = Provisioner(run_id, log_dir, hosts)
    try:
        yield _provisioner
    finally:
        # Shield: on Ctrl-C the enclosing task is being cancelled, and cleanup must still finish.
        await asyncio.shield(shutdown())
