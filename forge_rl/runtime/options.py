"""ActorOptions: where and how a ForgeActor runs (procs, GPUs, cores, host mesh, replicas), as
`ForgeActor.options(...)` takes them. One actor (forge_rl/runtime/actor.py) and a service's replicas
(forge_rl/runtime/service.py) read the same options."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ActorOptions:
    procs: int = 1  # procs per replica (e.g. tensor-parallel ranks)
    # The launcher's host mesh to run on ("trainer", "generator": see launch/launcher.py); None, or a name the
    # launcher has no mesh for, = the controller's host. A replica of a service takes one host of the mesh.
    host_mesh: str | None = None
    gpus: int = 0  # GPUs per proc (True = 1; e.g. vLLM's tensor_parallel_size), pinned before CUDA initialises
    replicas: int = 1  # only for as_service
    mesh_name: str | None = None  # defaults to the class name
    spmd: bool = False  # set up torch.distributed env inside the mesh (trainer ranks)
    # Cores of each proc (for a service: replica 0's procs, then replica 1's, ...); empty = not pinned.
    cpus: tuple[tuple[int, ...], ...] = ()
    threads: int = 0  # torch/OpenMP threads per proc; 0 = one per core of the proc
    share_gpus: bool = False  # time-share GPUs with other roles, not reserving them (colocated placement)
    # GPU ids of each replica (the placement plan's): replica r's procs take gpu_ids[r], `gpus` ids per proc in proc
    # order; empty = the provisioner picks (the next free GPUs, or with share_gpus the first visible ones).
    gpu_ids: tuple[tuple[str, ...], ...] = ()

    def cpus_of(self, replica: int = 0) -> list[list[int]] | None:
        """The core lists of one replica's procs."""
        if not self.cpus:
            return None
        lists = [list(c) for c in self.cpus[replica * self.procs : (replica + 1) * self.procs]]
        if len(lists) != self.procs:
            raise ValueError(
                f"ForgeActor option cpus has {len(self.cpus)} core lists; replica {replica} of "
                f"{self.procs} procs needs entries {replica * self.procs}..{(replica + 1) * self.procs - 1}"
            )
        return lists

    def gpu_ids_of(self, replica: int = 0) -> list[str] | None:
        """The GPU ids of one replica's procs (None: the provisioner picks)."""
        if not self.gpu_ids:
            return None
        if replica >= len(self.gpu_ids):
            raise ValueError(
                f"ForgeActor option gpu_ids lists {len(self.gpu_ids)} replicas' GPUs; replica {replica} has none"
            )
        return list(self.gpu_ids[replica])

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_ids", tuple(tuple(str(g) for g in ids) for ids in self.gpu_ids))
        for ids in self.gpu_ids:
            if len(ids) != self.procs * int(self.gpus) or len(set(ids)) != len(ids):
                raise ValueError(
                    f"ForgeActor option gpu_ids: replica GPUs {list(ids)} must be {self.procs} procs x "
                    f"{int(self.gpus)} gpus distinct ids"
                )
        for name in ("procs", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"ForgeActor option {name} must be >= 1, got {getattr(self, name)}")
        object.__setattr__(self, "gpus", int(self.gpus))  # gpus=True means one per proc
        if self.gpus < 0:
            raise ValueError(f"ForgeActor option gpus must be >= 0 (GPUs per proc), got {self.gpus}")
