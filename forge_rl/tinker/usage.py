"""What the service holds on its machine: its processes (this one, the actors' procs and vLLM's engine processes
they start) and their memory, which `/api/v1/healthz` reports so an operator sees that clients share processes
rather than each adding its own."""

import contextlib

import psutil


def process_usage() -> dict:
    """The service's process tree: how many processes, their resident memory (MiB, summed: pages shared between
    processes count in each), their unique memory (MiB: what stopping them would free), and both per name (a
    proc's name is `forge:<mesh>`, e.g. forge:trainer-1; vLLM's engine is VLLM::EngineCore)."""
    me = psutil.Process()
    by_name: dict[str, dict] = {}
    total = {"processes": 0, "rss_mib": 0.0, "uss_mib": 0.0}
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            info = proc.memory_full_info()
            name = proc.name()
            entry = by_name.setdefault(name, {"processes": 0, "rss_mib": 0.0, "uss_mib": 0.0})
            for bucket in (entry, total):
                bucket["processes"] += 1
                bucket["rss_mib"] += info.rss / 2**20
                bucket["uss_mib"] += info.uss / 2**20
    rounded = {name: {k: round(v, 1) for k, v in e.items()} for name, e in sorted(by_name.items())}
    return {**{k: round(v, 1) for k, v in total.items()}, "by_name": rounded}
