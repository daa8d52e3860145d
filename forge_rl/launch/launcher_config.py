"""Where a run's hosts come from (`launcher:` in a run's config): this machine, or a Slurm allocation whose
nodes, resources and job options are set here. The launcher itself is forge_rl/launch/launcher.py; this module
imports nothing heavy, so that a config is read quickly and without torch."""

from dataclasses import dataclass, field


@dataclass
class SlurmConfig:
    trainer_nodes: int = 1
    generator_nodes: int = 1
    gpus_per_node: int | None = None  # None: no GPUs asked for
    cpus_per_task: int | None = None
    mem: str | None = None  # e.g. "200G"
    partition: str | None = None
    time: str | None = None  # HH:MM:SS; None = the partition's default
    account: str | None = None
    qos: str | None = None
    exclusive: bool = True  # whole nodes
    # any other sbatch options, e.g. ["--signal=TERM@120", "--requeue", "--constraint=h100"]
    sbatch_args: list[str] = field(default_factory=list)
    port: int = 22222  # the Monarch workers' port on each node
    python: str | None = None  # the nodes' python; default: the controller's interpreter (a shared filesystem)
    job_name: str = "forge_rl"
    start_timeout_s: int | None = 900  # waiting in the queue; None = forever
    keep_job: bool = False  # leave the allocation running when the app exits (the next run reattaches)
    state_file: str = ".monarch/forge_rl_slurm.pkl"  # the cached job a re-run reattaches to
    log_dir: str | None = None  # the workers' Slurm output; default <output_dir>/slurm
    # This long before the job's time limit the app stops as on SIGTERM: a final checkpoint, a clean exit (at a
    # time limit Slurm signals every process of the job at once, workers included, too late to checkpoint).
    stop_before_end_s: float = 300.0  # 0 = off
    requeue_at_end: bool = False  # sbatch job: after that checkpoint, requeue the job; it resumes (resume: auto)

    def __post_init__(self) -> None:
        for name in ("trainer_nodes", "generator_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"launcher.slurm.{name} must be >= 1, got {getattr(self, name)}")
        for option in self.sbatch_args:
            if not option.startswith("-"):
                raise ValueError(f"launcher.slurm.sbatch_args: {option!r} is not an sbatch option (--name=value)")


@dataclass
class LauncherConfig:
    kind: str = "local"  # local | slurm
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        if self.kind not in ("local", "slurm"):
            raise ValueError(f"launcher.kind={self.kind!r}; choose local or slurm")
