"""How long the controller's event loop stops answering while a run checkpoint is saved (scaled down).

    PYTHONPATH=$PWD nice -n 15 .venv/bin/python benchmarks/checkpoint_stall.py --gb 1 --ranks 4

Four "ranks" write their DCP-like shards (`__<rank>_0.distcp`, sizes adding up to --gb) from threads, as the
trainer's processes would, and the controller commits the checkpoint with `commit_checkpoint` while a ticker
on its loop wakes every 10 ms and records the longest gap between two wake-ups. Where the ranks hash their own
files (forge_rl/runtime/manifest.py's `write_rank_digests`, this tree), they do; on a tree without it the
controller hashes everything itself, as forge_rl did before. The stall then grows with the checkpoint's size
(at a 32B model's several hundred GB of weights and optimizer state: minutes); without it it should not.
"""

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from forge_rl.loop.checkpoint import commit_checkpoint

try:
    from forge_rl.runtime.manifest import write_rank_digests
except ImportError:  # a forge_rl from before the ranks hashed their own files
    write_rank_digests = None

BLOCK = 16 << 20


def write_shard(path: Path, size: int, rank: int) -> None:
    block = os.urandom(BLOCK)
    with open(path / f"__{rank}_0.distcp", "wb") as fh:
        for _ in range(size // BLOCK):
            fh.write(block)
    if rank == 0:
        (path / ".metadata").write_bytes(b"metadata")
    if write_rank_digests is not None:
        write_rank_digests(path, rank)


async def save(root: Path, step: int, gb: float, ranks: int) -> tuple[float, float]:
    """(longest gap of the controller's 10 ms ticker, seconds) of one save."""
    longest, stop = 0.0, asyncio.Event()

    async def ticker():
        nonlocal longest
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            longest, last = max(longest, now - last - 0.01), now

    async def write(partial: Path) -> None:
        partial.mkdir(parents=True)
        size = int(gb * (1 << 30)) // ranks
        await asyncio.gather(*(asyncio.to_thread(write_shard, partial, size, r) for r in range(ranks)))
        (partial / "app_state.pt").write_bytes(os.urandom(1 << 20))

    tick = asyncio.create_task(ticker())
    start = time.perf_counter()
    await commit_checkpoint(root, step, "bench", write, keep_last=1)
    took = time.perf_counter() - start
    stop.set()
    await tick
    return longest, took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--saves", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="checkpoint-stall-"))
    try:
        for step in range(1, args.saves + 1):
            longest, took = asyncio.run(save(root, step, args.gb, args.ranks))
            print(f"save {step}: {args.gb:g} GB from {args.ranks} ranks in {took:.1f} s; the controller's loop "
                  f"stalled at most {longest * 1000:.0f} ms (ranks hash their own files: "
                  f"{write_rank_digests is not None}; python {sys.version.split()[0]})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
