"""What a weight-store publish pays for fresh shared-memory pages, against one into a recycled version's pages.

    python -m benchmarks.shm_first_publish [--gb 1.2] [--versions 4] [--step-s 5]

A publisher writes versions 1..N of one bf16 state dict of --gb from CPU tensors, --step-s apart (a train step;
keep_versions=2: version 1 gets fresh tmpfs pages, version 2 a spare file prepared meanwhile (spares.py), version 3
on recycle a dropped version's). For each: the publish's time and a reader's load of it in another process (its
map, and reading every page once, as a generator's load does). Then a fresh file's parts one by one (reserving
its pages with posix_fallocate, mapping it with MAP_POPULATE, the copy), and again with its pages faulted in ahead.
"""

import argparse
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

READER = """
import sys, time, torch
from forge_rl.weights import ShmWeightStore, WeightStoreConfig
store = ShmWeightStore(sys.argv[1], WeightStoreConfig(root=sys.argv[2], keep_versions=2))
print("ready", flush=True)
for line in sys.stdin:
    v = int(line)
    t0 = time.perf_counter(); views = store.load(v); t1 = time.perf_counter()
    s = sum(float(t[::4096].float().sum()) for t in views.values()); t2 = time.perf_counter()
    del views
    print(f"{t1 - t0:.3f} {t2 - t1:.3f}", flush=True)
"""


def state_dict(gb: float) -> dict[str, torch.Tensor]:
    n = int(gb * 1e9 / 2 / 12)
    return {f"layer{i}.weight": torch.full((n,), float(i), dtype=torch.bfloat16) for i in range(12)}


def parts_of_a_fresh_file(path: Path, size: int, prefault: bool, src: torch.Tensor) -> dict[str, float]:
    """The writer's steps on a new file, timed one by one (what ShmVersionWriter does for a fresh version)."""
    t = {}
    start = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    t["fallocate"] = time.perf_counter() - start
    if prefault:  # write every page once ahead, as a spare file prepared before the publish would be
        start = time.perf_counter()
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        torch.frombuffer(mm, dtype=torch.uint8).zero_()
        del mm
        t["prefault (zero every page)"] = time.perf_counter() - start
    start = time.perf_counter()
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    t["map (MAP_POPULATE)"] = time.perf_counter() - start
    start = time.perf_counter()
    torch.frombuffer(mm, dtype=torch.uint8).copy_(src)
    t["copy"] = time.perf_counter() - start
    os.close(fd)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.2)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=5.0)
    args = ap.parse_args()
    import torch.distributed.tensor  # noqa: F401  publish() imports it: ~1 s once, already paid in a trainer

    from forge_rl.weights import ShmWeightStore, WeightStoreConfig

    sd = state_dict(args.gb)
    root = Path(tempfile.mkdtemp(prefix="forge_rl-bench-first-publish-", dir="/dev/shm"))
    run_id = f"bench-first-publish-{os.getpid()}"
    store = ShmWeightStore(run_id, WeightStoreConfig(root=str(root), keep_versions=2))
    reader = subprocess.Popen([sys.executable, "-c", READER, run_id, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "ready"  # its imports done: they would compete with version 1
    try:
        for v in range(1, args.versions + 1):
            recycled, from_spares = store.recycled, store.from_spares
            time.sleep(args.step_s if v > 1 else 0)
            start = time.perf_counter()
            store.publish(v, sd)
            took = time.perf_counter() - start
            reader.stdin.write(f"{v}\n")
            reader.stdin.flush()
            load_s, read_s = reader.stdout.readline().split()
            pages = ("recycled pages" if store.recycled > recycled else "a spare file's pages, faulted in after "
                     "version 1" if store.from_spares > from_spares else "fresh pages")
            print(f"version {v} ({pages}): publish {took:.3f} s; reader: load (map) {load_s} s, "
                  f"read every page {read_s} s", flush=True)
        size = sum(t.numel() * 2 for t in sd.values())
        src = torch.cat([t.view(torch.uint8) for t in sd.values()])
        for prefault in (False, True):
            path = root / f"parts-{prefault}"
            parts = parts_of_a_fresh_file(path, size, prefault, src)
            path.unlink()
            print(f"a fresh {size / 1e9:.2f} GB file{', pages faulted in ahead' if prefault else ''}: "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()), flush=True)
    finally:
        reader.stdin.close()
        reader.wait()
        store.close()
        subprocess.run(["rm", "-rf", str(root)])


if __name__ == "__main__":
    main()
