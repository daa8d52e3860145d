"""Placement: which cores, threads and GPUs each role gets, so the processes on a host never fight.

    placement = plan_placement(ResourcesConfig(), trainer_procs=1, generator_replicas=1, generator_gpus=0)
    print(placement.describe())

- disaggregated: generator replicas and trainer ranks on separate cores (CPU) or separate GPUs, running
  at the same time.
- colocated: generator and trainer time-share the same cores or GPU. The generator's engine is paused
  while the trainer steps (on GPU it also sleeps, freeing its memory), so each role gets the whole device
  when it runs; what does not need the device (rewards, publishing weights, data) still overlaps.
- auto: disaggregated when every role can have devices of its own, colocated otherwise.

On CPU each proc is pinned (sched_setaffinity) to its cores with as many torch/OpenMP threads as cores,
and a vLLM CPU engine binds its OpenMP threads to its replica's cores (VLLM_CPU_OMP_THREADS_BIND). Cores
can be given explicitly (`generator_cpus: "0-3|4-7"` for two replicas, `trainer_cpus: "8-15"`); anything
not given is derived from the cores this process may use, in the order FORGE_RL_CPUS lists them where it is set
(usable_cores: how two runs share one host's cores).

On GPUs the plan names the devices: one GPU per trainer rank (the first ones) and `tensor_parallel_size` GPUs per
generator replica, no two replicas on the same GPU, spread evenly over the visible GPUs (colocated: over all of
them, time-shared with the trainer's ranks) or over those the trainer does not take (disaggregated). The
provisioner pins exactly those ids (ActorOptions.gpu_ids). Colocated on a GPU, forge_rl/runtime/memory_plan.py
sizes the engine's share of each device.
"""

import os
from dataclasses import dataclass, field

from forge_rl.errors import ConfigError

PLACEMENTS = ("auto", "colocated", "disaggregated")
CPUS_ENV = "FORGE_RL_CPUS"  # the cores derived placement uses, in order (usable_cores)


@dataclass
class ResourcesConfig:
    placement: str = "auto"  # auto | colocated | disaggregated
    generator_cpus: str = ""  # cores per generator replica, "|" between replicas ("0-3|4-7"); "" = derived
    trainer_cpus: str = ""  # cores shared by the trainer ranks, split evenly ("4-7"); "" = derived
    trainer_threads: int = 0  # torch threads per trainer rank; 0 = one per core of the rank
    generator_share: float = 0.5  # disaggregated on CPU: fraction of the cores for generation when derived
    # Reward models (rewards entries with `model:`), in their order, "|" between models: their cores ("6-7|6-7";
    # "" = not pinned) and their GPU ids ("3|3"; "" = the next GPU no other role takes, else the last one, shared)
    reward_model_cpus: str = ""
    reward_model_gpus: str = ""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"resources.placement={self.placement!r}; choose one of {PLACEMENTS}")
        if self.trainer_threads < 0:
            raise ConfigError(f"resources.trainer_threads must be >= 0, got {self.trainer_threads}")
        if not 0 < self.generator_share < 1:
            raise ConfigError(f"resources.generator_share must be in (0, 1), got {self.generator_share}")


@dataclass
class Placement:
    mode: str  # "colocated" | "disaggregated"
    device: str  # "cpu" | "cuda"
    generator_cpus: list[list[int]] = field(default_factory=list)  # per replica (per proc of a replica)
    trainer_cpus: list[list[int]] = field(default_factory=list)  # per trainer rank
    trainer_threads: int = 0
    gpus: list[str] = field(default_factory=list)  # the visible GPUs
    trainer_gpus: list[str] = field(default_factory=list)  # one per trainer rank
    generator_gpus: list[list[str]] = field(default_factory=list)  # per replica: its tensor_parallel_size GPUs
    note: str = ""  # roles on hosts of their own (a launcher's host meshes): where they are
    reward_model_cpus: list[list[int]] = field(default_factory=list)  # per reward model; [] = not pinned
    reward_model_gpus: list[list[str]] = field(default_factory=list)  # per reward model (GPU hosts)

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    def describe(self) -> str:
        rms = [f"GPUs {_fmt(g)}" for g in self.reward_model_gpus] or [
            f"cores {_fmt(c)}" for c in self.reward_model_cpus
        ]
        return self._describe_roles() + (f"; reward models on [{' | '.join(rms)}]" if rms else "")

    def _describe_roles(self) -> str:
        if self.note:
            return f"placement {self.mode}: {self.note}"
        if self.device == "cuda":
            share = "time-shared: vLLM sleeps while the trainer steps" if self.colocated else "one set per role"
            gen = " | ".join(_fmt(g) for g in self.generator_gpus)
            return (
                f"placement {self.mode} on GPUs {_fmt(self.gpus)} ({share}): generator replicas [{gen}], "
                f"trainer ranks on GPUs [{_fmt(self.trainer_gpus)}]"
            )
        gen = " | ".join(_fmt(c) for c in self.generator_cpus)
        train = " | ".join(_fmt(c) for c in self.trainer_cpus)
        how = "time-shared: the generator pauses while the trainer steps" if self.colocated else "side by side"
        cores = _fmt(sorted({c for cs in self.generator_cpus + self.trainer_cpus for c in cs}))
        return (
            f"placement {self.mode} on CPU cores {cores}"
            f" ({how}): generator replicas [{gen}], trainer ranks [{train}] x {self.trainer_threads} threads"
        )


def plan_placement(
    cfg: ResourcesConfig,
    trainer_procs: int,
    generator_replicas: int,
    generator_gpus: int,
    gpus: list[str] | None = None,
    cores: list[int] | None = None,
) -> Placement:
    """Decide and check where every role runs. Errors name the config keys that conflict."""
    if gpus:
        return _plan_gpus(cfg, trainer_procs, generator_replicas, generator_gpus, gpus)
    cores = sorted(cores) if cores is not None else usable_cores()
    gen = (
        [parse_cpus(s, "resources.generator_cpus") for s in cfg.generator_cpus.split("|")] if cfg.generator_cpus else []
    )
    train = parse_cpus(cfg.trainer_cpus, "resources.trainer_cpus") if cfg.trainer_cpus else []
    if gen and len(gen) != generator_replicas:
        raise ConfigError(
            f"resources.generator_cpus={cfg.generator_cpus!r} lists {len(gen)} replicas' cores; "
            f"generator.replicas={generator_replicas}"
        )
    for name, listed in (("generator_cpus", [c for g in gen for c in g]), ("trainer_cpus", train)):
        if outside := sorted(set(listed) - set(cores)):
            raise ConfigError(
                f"resources.{name} names cores {outside} that this process may not use (it may use {_fmt(cores)})"
            )
    given = {c for g in gen for c in g}
    mode = cfg.placement
    if mode == "auto":
        overlap = bool(set(train) & given)
        mode = "colocated" if overlap or len(cores) < generator_replicas + trainer_procs else "disaggregated"
    if mode == "colocated":
        gen, train = gen or [cores] * generator_replicas, train or cores
    else:
        if overlap := set(train) & given:
            raise ConfigError(
                f"resources.placement=disaggregated but resources.generator_cpus and "
                f"resources.trainer_cpus share cores {sorted(overlap)}"
            )
        free = [c for c in cores if c not in given and c not in train]
        if not gen:
            n = max(generator_replicas, round(len(cores) * cfg.generator_share))
            n = min(n, len(free) - (0 if train else trainer_procs))
            if n < generator_replicas:
                raise ConfigError(
                    f"resources.placement=disaggregated needs a core per generator replica ({generator_replicas}) and "
                    f"per trainer rank ({trainer_procs}); this process may use {len(cores)} cores ({_fmt(cores)}); "
                    "use resources.placement=colocated (or auto)"
                )
            gen, free = _split(free[:n], generator_replicas), free[n:]
        train = train or free
    if any(not g for g in gen):
        raise ConfigError(f"every generator replica needs at least one core, got {gen} (resources.generator_cpus)")
    if len(train) < trainer_procs:
        raise ConfigError(
            f"trainer cores {_fmt(train)} are fewer than trainer_procs={trainer_procs} (resources.trainer_cpus)"
        )
    ranks = _split(train, trainer_procs)
    return Placement(
        mode, "cpu", generator_cpus=gen, trainer_cpus=ranks, trainer_threads=cfg.trainer_threads or len(ranks[0])
    )


def usable_cores() -> list[int]:
    """The cores derived placement hands out, in the order it hands them out (the generator's first): FORGE_RL_CPUS
    ("1,0", "4-7") where it is set, else the cores this process may use, ascending. Two runs sharing a host's cores
    list them in opposite orders, so that one's generator runs beside the other's trainer instead of both generators
    on the same cores while both trainers' cores wait."""
    allowed = sorted(os.sched_getaffinity(0))
    if not (text := os.environ.get(CPUS_ENV, "").strip()):
        return allowed
    listed = parse_cpus(text, CPUS_ENV)
    if outside := sorted(set(listed) - set(allowed)):
        raise ConfigError(
            f"{CPUS_ENV}={text!r} names cores {outside} that this process may not use ({_fmt(allowed)}): "
            f"list some of those, or unset {CPUS_ENV}"
        )
    return listed


def plan_reward_models(
    cfg: ResourcesConfig, placement: Placement, models: int, cores: list[int] | None = None
) -> Placement:
    """Where each of `models` reward models runs (placement.reward_model_cpus / _gpus, in `rewards` order).
    On CPU: the cores resources.reward_model_cpus gives each, or none pinned (they share the machine). On GPUs:
    the ids resources.reward_model_gpus gives each, or the next GPU neither the trainer nor a generator replica
    takes, or (none is free) the last visible GPU, time-shared."""

    def per_model(text: str, key: str) -> list[str]:
        parts = text.split("|") if text else []
        if parts and len(parts) != models:
            raise ConfigError(
                f"resources.{key}={text!r} lists {len(parts)} reward models' devices; rewards has "
                f"{models} entries with a model"
            )
        return parts

    cpus, gpus = (
        per_model(cfg.reward_model_cpus, "reward_model_cpus"),
        per_model(cfg.reward_model_gpus, "reward_model_gpus"),
    )
    if placement.device == "cpu":
        if gpus:
            raise ConfigError("resources.reward_model_gpus names GPUs, but this host has none visible")
        allowed = set(cores if cores is not None else os.sched_getaffinity(0))
        placement.reward_model_cpus = [parse_cpus(c, "resources.reward_model_cpus") for c in cpus]
        if outside := sorted({c for cs in placement.reward_model_cpus for c in cs} - allowed):
            raise ConfigError(f"resources.reward_model_cpus names cores {outside} that this process may not use")
        return placement
    if cpus:
        raise ConfigError(
            "resources.reward_model_cpus pins CPU roles; on GPUs reward models get devices "
            "(resources.reward_model_gpus)"
        )
    for ids in gpus:
        if unknown := [g for g in ids.split(",") if g not in placement.gpus]:
            raise ConfigError(
                f"resources.reward_model_gpus={cfg.reward_model_gpus!r} names GPUs {unknown}; "
                f"visible: {_fmt(placement.gpus)}"
            )
    taken = set(placement.trainer_gpus) | {g for r in placement.generator_gpus for g in r}
    free = [g for g in placement.gpus if g not in taken] or placement.gpus[-1:]
    placement.reward_model_gpus = (
        [ids.split(",") for ids in gpus] if gpus else [[free[i % len(free)]] for i in range(models)]
    )
    return placement


def _plan_gpus(cfg: ResourcesConfig, trainer_procs: int, replicas: int, per_replica: int, gpus: list[str]) -> Placement:
    """The GPU ids of every trainer rank and generator replica, checked as they are chosen (the provisioner pins
    exactly these): trainer rank i on the i-th GPU; replica r on `per_replica` GPUs of its own, spread evenly over
    all the GPUs (colocated) or over those after the trainer's (disaggregated)."""
    if cfg.generator_cpus or cfg.trainer_cpus:
        raise ConfigError("resources.generator_cpus / resources.trainer_cpus pin CPU roles; on GPUs roles get devices")
    if per_replica < 1:
        raise ConfigError(f"generator.engine_args.tensor_parallel_size={per_replica}: a replica on GPUs needs >= 1")
    wanted = trainer_procs + replicas * per_replica
    mode = cfg.placement
    if mode == "auto":
        mode = "disaggregated" if len(gpus) >= wanted else "colocated"
    if mode == "disaggregated" and len(gpus) < wanted:
        raise ConfigError(
            f"resources.placement=disaggregated needs {wanted} GPUs (trainer_procs={trainer_procs} + "
            f"generator.replicas={replicas} x generator.engine_args.tensor_parallel_size={per_replica}); "
            f"{len(gpus)} visible ({_fmt(gpus)}): use resources.placement=colocated (or auto), or fewer"
        )
    if mode == "colocated" and (trainer_procs > len(gpus) or replicas * per_replica > len(gpus)):
        raise ConfigError(
            f"resources.placement=colocated time-shares the {len(gpus)} visible GPUs ({_fmt(gpus)}) with one "
            f"trainer rank per GPU and distinct GPUs per replica: trainer_procs={trainer_procs} and "
            f"generator.replicas={replicas} x generator.engine_args.tensor_parallel_size={per_replica} "
            f"must each be at most {len(gpus)}"
        )
    trainer = list(gpus[:trainer_procs])
    pool = list(gpus) if mode == "colocated" else list(gpus[trainer_procs:])
    stride = len(pool) // replicas  # >= per_replica, by the checks above
    generator = [pool[r * stride : r * stride + per_replica] for r in range(replicas)]
    return Placement(mode, "cuda", gpus=list(gpus), trainer_gpus=trainer, generator_gpus=generator)


def parse_cpus(text: str, key: str) -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6]; errors name `key`."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(f"{key}={text!r}: expected core ids like '0-3,6'") from None
    if not out or len(set(out)) != len(out):
        raise ConfigError(f"{key}={text!r}: expected distinct core ids like '0-3,6'")
    return out


def _split(cores: list[int], n: int) -> list[list[int]]:
    per = len(cores) // n
    return [cores[i * per : (i + 1) * per] for i in range(n)]


def _fmt(ids: list) -> str:
    return ",".join(map(str, ids))
