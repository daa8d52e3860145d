"""Weight sync benchmark: publish + fetch a 100M and a 500M-param fp32 model through the weight store.

    .venv/bin/python -m benchmarks.weight_sync [--sizes 100M,500M] [--rounds 3] [--rdma-sizes 100M]

Same host: a writer proc publishes version v (full tensors), a reader proc prefetches v and loads it
(zero-copy views of the version in shared memory): that is the store's end-to-end. The reader then
copies the views into its own preallocated tensors (what a generator materialising weights does),
shown as a second end-to-end. Compared with a plain torch copy_ of the same tensors in the reader proc. Across
hosts: two Monarch ProcessJob
"hosts" on this machine; the reader prefetches over Monarch RDMA (TCP fallback without InfiniBand).
Shared memory per host is sampled throughout and must stay <= keep_versions x model bytes.
"""

import argparse
import asyncio
import os
import statistics
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Monarch procs import this module by name (benchmarks.weight_sync), so they need the repo on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

import torch  # noqa: E402
from monarch.actor import Actor, endpoint  # noqa: E402

from benchmarks.shapes import model_spec  # noqa: E402
from forge_rl.weights import ShmWeightStore, WeightStoreConfig  # noqa: E402

KEEP = 2


class BenchWriter(Actor):
    def __init__(self, size: str, cfg: WeightStoreConfig):
        self.store = ShmWeightStore(cfg=cfg)
        self.state = {n: torch.empty(s) for n, s in model_spec(size).items()}

    @endpoint
    async def prepare(self, version: int) -> None:
        for t in self.state.values():  # the trainer's new weights (not timed)
            t.fill_(float(version))

    @endpoint
    async def publish(self, version: int) -> float:
        t0 = time.perf_counter()
        self.store.publish(version, self.state)
        return time.perf_counter() - t0

    @endpoint
    async def recycled(self) -> int:
        return self.store.recycled


class BenchReader(Actor):
    def __init__(self, size: str, cfg: WeightStoreConfig, source=None):
        self.store = ShmWeightStore(cfg=cfg, source=source)
        self.own = {n: torch.zeros(s) for n, s in model_spec(size).items()}  # the generator's weights

    @endpoint
    async def fetch(self, version: int) -> tuple[float, float]:
        """(seconds to prefetch + load views, seconds to copy the views into own tensors)."""
        t0 = time.perf_counter()
        await self.store.prefetch(version, timeout=600)
        views = self.store.load(version)
        t1 = time.perf_counter()
        for name, t in views.items():
            self.own[name].copy_(t)
        t2 = time.perf_counter()
        del views  # unpins the version: the writer may recycle its pages
        return t1 - t0, t2 - t1

    @endpoint
    async def check(self, version: int) -> None:
        wrong = [n for n, t in self.own.items() if not bool((t == version).all())]
        assert not wrong, f"version {version}: wrong weights in {wrong[:3]}"

    @endpoint
    async def memcpy(self) -> float:
        """Plain copy_ of the same tensors into preallocated (warm) tensors."""
        src = {n: torch.full_like(t, 1.0) for n, t in self.own.items()}
        for name, t in src.items():  # warm both sides once
            self.own[name].copy_(t)
        t0 = time.perf_counter()
        for name, t in src.items():
            self.own[name].copy_(t)
        return time.perf_counter() - t0


class ShmSampler:
    """Peak bytes of /dev/shm held by the run, per host directory (sampled every 5 ms), and the peak
    rise of the machine's Shmem (/proc/meminfo): that one also counts files unlinked but still mapped."""

    def __init__(self, run_id: str):
        self.prefix, self.peak = f"forge_rl-{run_id}-weights-", {}
        self.shmem_base = self.shmem_peak = _shmem()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.005):
            self.shmem_peak = max(self.shmem_peak, _shmem())
            for root in Path("/dev/shm").glob(self.prefix + "*"):
                held = {}  # by inode: a recycled file is briefly linked under two names
                for dirpath, _, files in os.walk(root):
                    for f in files:
                        try:
                            st = os.stat(os.path.join(dirpath, f))
                        except FileNotFoundError:
                            continue
                        held[st.st_ino] = st.st_blocks * 512
                host = root.name[len(self.prefix) :]
                self.peak[host] = max(self.peak.get(host, 0), sum(held.values()))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak | {"all (meminfo)": self.shmem_peak - self.shmem_base}


def _shmem() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Shmem:"))


WARMUP = 3  # versions 1..K+1: first touch of the procs' own memory, of the K files, of their maps


async def measure(writer, reader, rounds: int) -> dict:
    """Publish + fetch `rounds` versions after WARMUP, then three memcpy references in the reader.
    Per round: publish, fetch (prefetch + load), copy, end-to-end without and with the copy (medians)."""
    times: dict[str, list[float]] = {k: [] for k in ("publish", "fetch", "copy", "e2e", "e2e_copy")}
    for v in range(1, rounds + WARMUP + 1):
        await writer.prepare.call_one(v)
        t0 = time.perf_counter()
        pub = await writer.publish.call_one(v)
        fetch, copy = await reader.fetch.call_one(v)
        wall = time.perf_counter() - t0
        await reader.check.call_one(v)
        if v > WARMUP:
            for k, x in zip(times, (pub, fetch, copy, wall - copy, wall)):
                times[k].append(x)
    mems = [await reader.memcpy.call_one() for _ in range(3)]
    out = {k: statistics.median(x) for k, x in times.items()}
    out["memcpy"] = statistics.median(mems)
    out["recycled"] = await writer.recycled.call_one()
    return out


async def same_host(size: str, rounds: int, me) -> dict:
    from forge_rl.runtime import provisioned

    nbytes = sum(4 * torch.Size(s).numel() for s in model_spec(size).values())
    async with provisioned() as prov:
        sampler = ShmSampler(prov.run_id)
        cfg = WeightStoreConfig(keep_versions=KEEP)
        wmesh, rmesh = await prov.get_proc_mesh(mesh_name="writer"), await prov.get_proc_mesh(mesh_name="reader")
        writer = wmesh.spawn("writer", me.BenchWriter, size, cfg)
        reader = rmesh.spawn("reader", me.BenchReader, size, cfg)
        row = await measure(writer, reader, rounds)
        peak = sampler.stop()
    return dict(size=size, path="same host (shm)", bytes=nbytes, shm=peak, rounds=rounds, **row)


async def cross_host(size: str, rounds: int, me, bucket_mb: int) -> dict:
    from monarch.job import ProcessJob

    from forge_rl.runtime import provisioned
    from forge_rl.weights.rdma import WeightServer

    nbytes = sum(4 * torch.Size(s).numel() for s in model_spec(size).values())
    async with provisioned() as prov:
        sampler = ShmSampler(prov.run_id)
        cfg = WeightStoreConfig(keep_versions=KEEP, bucket_mb=bucket_mb)
        env = {"FORGE_RL_RUN_ID": prov.run_id, "PYTHONPATH": os.environ["PYTHONPATH"]}
        jobs = [ProcessJob({"host": 1}, env={**env, "FORGE_RL_HOST_ID": h}) for h in ("A", "B")]
        meshes = []
        try:
            meshes = [j.state(cached_path=None).host.spawn_procs(per_host={"procs": 1}) for j in jobs]
            writer = meshes[0].spawn("writer", me.BenchWriter, size, cfg)
            server = meshes[0].spawn("server", WeightServer, prov.run_id, cfg)
            reader = meshes[1].spawn("reader", me.BenchReader, size, cfg, server)
            row = await measure(writer, reader, rounds)
        finally:
            for m in meshes:
                await m.stop()
            for j in jobs:
                j.kill()
        peak = sampler.stop()
    return dict(
        size=size, path=f"cross host (RDMA, {cfg.bucket_mb} MB buckets)", bytes=nbytes, shm=peak, rounds=rounds, **row
    )


def table(rows: list[dict]):
    from rich.table import Table

    t = Table(title=f"weight sync, fp32, keep_versions={KEEP}, {os.cpu_count()}-core CPU (GB/s = 1e9 B/s, median)")
    for col in (
        "model",
        "path",
        "GB",
        "publish GB/s",
        "fetch GB/s",
        "end-to-end GB/s (s)",
        "memcpy warm GB/s",
        "e2e / memcpy",
        "+ copy out GB/s",
        "e2e + copy / memcpy",
        "recycled",
        "peak shm per host (GB)",
        "<= K x model",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        gb = r["bytes"] / 1e9
        hosts = {h: b for h, b in r["shm"].items() if h != "all (meminfo)"}
        peak = max(max(hosts.values(), default=0), r["shm"]["all (meminfo)"] / max(len(hosts), 1))
        t.add_row(
            r["size"],
            r["path"],
            f"{gb:.2f}",
            f"{gb / r['publish']:.2f}",
            f"{gb / r['fetch']:.2f}",
            f"{gb / r['e2e']:.2f} ({r['e2e']:.3f})",
            f"{gb / r['memcpy']:.2f}",
            f"{r['memcpy'] / r['e2e']:.2f}x",
            f"{gb / r['e2e_copy']:.2f}",
            f"{r['memcpy'] / r['e2e_copy']:.2f}x",
            f"{r['recycled']}/{r['rounds'] + WARMUP}",
            ", ".join(f"{h}: {b / 1e9:.2f}" for h, b in sorted(r["shm"].items())),
            "yes" if peak <= KEEP * (r["bytes"] + (1 << 20)) else "NO",  # + 1 MiB: safetensors header
        )
    return t


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100M,500M")
    ap.add_argument("--rdma-sizes", default="100M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", default="64", help="RDMA bucket sizes to try, e.g. 64,256")
    args = ap.parse_args()
    import benchmarks.weight_sync as me  # actors by their importable name, not __main__

    from rich.console import Console

    torch.set_num_threads(os.cpu_count() or 1)
    os.environ.pop("FORGE_RL_RUN_ID", None)
    rows = []
    for size in args.sizes.split(","):
        rows.append(await same_host(size, args.rounds, me))
    for size in filter(None, args.rdma_sizes.split(",")):
        for bucket_mb in args.bucket_mb.split(","):
            rows.append(await cross_host(size, args.rounds, me, int(bucket_mb)))
    Console(width=250).print(table(rows))
    print(
        "publish: writer proc, copy into the version file (a dropped version's pages where free: 'recycled');\n"
        "fetch: reader proc, prefetch + load (zero-copy views; across hosts the RDMA copy to this host);\n"
        "end-to-end: controller wall time of publish then fetch (+ copy out: the reader then copies the views into\n"
        "its own preallocated tensors); memcpy: torch copy_ of the same tensors into preallocated tensors, reader proc."
    )


if __name__ == "__main__":
    asyncio.run(main())
