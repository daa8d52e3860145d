"""Weight sync on one GPU host: trainer GPU -> shared memory -> generator GPU, through the weight store.

    python -m benchmarks.weight_sync_gpu [--sizes 500M,1.7B] [--rounds 5]

Two OS processes (no Monarch needed, so it runs on a bare CUDA machine): a writer holding the model on
the GPU publishes each version from its CUDA tensors (device-to-host copies straight into the version
file), and a reader loads the version (zero-copy views) and copies it into its own CUDA tensors (what a
generator's weight reload does). Compared in the same run with the plain copies a single process would
do: GPU -> pinned host -> GPU, and GPU -> pageable host -> GPU.
"""

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid

import torch

from benchmarks.shapes import model_spec

DTYPES = {"500M": torch.float32, "1.7B": torch.bfloat16}


def state_on_gpu(size: str, value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full(s, value, dtype=DTYPES[size], device="cuda") for n, s in model_spec(size).items()}


def writer(size: str, run_id: str, rounds: int, go, done, times) -> None:
    from forge_rl.weights import ShmWeightStore, WeightStoreConfig

    store = ShmWeightStore(run_id, WeightStoreConfig(keep_versions=2))
    state = state_on_gpu(size, 0.0)
    for v in range(1, rounds + 1):
        for t in state.values():
            t.fill_(float(v))
        torch.cuda.synchronize()
        go.wait()
        go.clear()
        t0 = time.perf_counter()
        store.publish(v, state)
        times.put(("publish", v, time.perf_counter() - t0))
        done.wait()
        done.clear()
    store.close()


def reader(size: str, run_id: str, rounds: int, times) -> None:
    from forge_rl.weights import ShmWeightStore, WeightStoreConfig

    store = ShmWeightStore(run_id, WeightStoreConfig(keep_versions=2))
    own = state_on_gpu(size, -1.0)
    for v in range(1, rounds + 1):
        store.wait(v, timeout=600)
        t0 = time.perf_counter()
        views = store.load(v)
        for name, t in views.items():
            own[name].copy_(t, non_blocking=False)
        torch.cuda.synchronize()
        times.put(("fetch", v, time.perf_counter() - t0))
        del views
        assert all(bool((t == v).all()) for t in own.values()), f"version {v}: wrong weights"
    store.close()


def baselines(size: str) -> dict[str, float]:
    """Plain GPU -> host -> GPU of the same tensors in one process (median of 3 after a warm-up)."""
    src, dst = state_on_gpu(size, 1.0), state_on_gpu(size, 0.0)
    out = {}
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for n, t in src.items()}
        runs = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for n, t in src.items():
                host[n].copy_(t)
            for n, t in host.items():
                dst[n].copy_(t)
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        out[kind] = statistics.median(runs[1:])
        del host
    return out


def run_size(size: str, rounds: int) -> dict:
    ctx = mp.get_context("spawn")
    run_id = f"gpubench{uuid.uuid4().hex[:6]}"
    go, done, times = ctx.Event(), ctx.Event(), ctx.Queue()
    w = ctx.Process(target=writer, args=(size, run_id, rounds, go, done, times))
    r = ctx.Process(target=reader, args=(size, run_id, rounds, times))
    w.start(), r.start()
    rows: dict[str, dict[int, float]] = {"publish": {}, "fetch": {}}
    for v in range(1, rounds + 1):
        go.set()
        while v not in rows["fetch"]:
            kind, version, s = times.get(timeout=600)
            rows[kind][version] = s
        done.set()
    w.join(), r.join()
    assert w.exitcode == 0 and r.exitcode == 0, (w.exitcode, r.exitcode)
    warm = range(4, rounds + 1)  # after versions 1..3: first touch, the K files, their maps
    nbytes = sum(torch.Size(s).numel() * DTYPES[size].itemsize for s in model_spec(size).values())
    return dict(
        size=size,
        bytes=nbytes,
        publish=statistics.median(rows["publish"][v] for v in warm),
        fetch=statistics.median(rows["fetch"][v] for v in warm),
        **baselines(size),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="500M,1.7B")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"weight sync GPU -> shm -> GPU, {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs "
        "(GB/s = 1e9 B/s, median)"
    )
    for col in (
        "model",
        "dtype",
        "GB",
        "publish (D2H) GB/s",
        "load + H2D GB/s",
        "store end-to-end GB/s (s)",
        "pinned D2H+H2D GB/s",
        "e2e / pinned",
        "pageable D2H+H2D GB/s",
        "e2e / pageable",
    ):
        t.add_column(col, justify="right")
    for size in args.sizes.split(","):
        r = run_size(size, args.rounds)
        gb, e2e = r["bytes"] / 1e9, r["publish"] + r["fetch"]
        t.add_row(
            size,
            str(DTYPES[size]).removeprefix("torch."),
            f"{gb:.2f}",
            f"{gb / r['publish']:.2f}",
            f"{gb / r['fetch']:.2f}",
            f"{gb / e2e:.2f} ({e2e:.3f})",
            f"{gb / r['pinned']:.2f}",
            f"{r['pinned'] / e2e:.2f}x",
            f"{gb / r['pageable']:.2f}",
            f"{r['pageable'] / e2e:.2f}x",
        )
    Console(width=220).print(t)


if __name__ == "__main__":
    main()
