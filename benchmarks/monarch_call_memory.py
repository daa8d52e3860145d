"""Native memory an endpoint call leaves in the calling process (Monarch), measured.

    .venv/bin/python benchmarks/monarch_call_memory.py [--calls 100000] [--payload 100] [--mode call_one|replies]

Spawns one proc with an echo actor and calls it `--calls` times with a `--payload`-byte argument, printing the
caller's RSS and Python-heap size (tracemalloc) every tenth of the way, then the growth per call. Monarch 0.7.0:
about 1.2 KB per `call_one`, linear, independent of the payload, outside Python's heap (docs/stack.md).
`--mode replies` makes the same calls the way forge_rl's hot calls go (forge_rl/runtime/replies.py: a
one-way broadcast, the reply over one long-lived port).
"""

import argparse
import asyncio
import time
import tracemalloc

import psutil
from monarch.actor import endpoint, this_host

from forge_rl.runtime import ForgeActor
from forge_rl.runtime.replies import replies


class Echo(ForgeActor):
    @endpoint
    async def echo(self, x):
        return x


async def measure(calls: int, payload: int, mode: str) -> None:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    echo = procs.spawn("echo", Echo)
    data = bytes(payload)

    async def call(x):
        return await (echo.echo.call_one(x) if mode == "call_one" else replies().call(echo, "echo", x))

    for _ in range(1000):  # warm-up: connections, first-call allocations
        await call(data)
    me = psutil.Process()
    tracemalloc.start()
    rss0, start = me.memory_info().rss, time.perf_counter()
    print("| calls | RSS (MiB) | Python heap (MiB) | us/call |\n|---|---|---|---|")
    step = max(1, calls // 10)
    for done in range(step, calls + 1, step):
        t = time.perf_counter()
        for _ in range(step):
            await call(data)
        print(f"| {done} | {me.memory_info().rss / 2**20:.1f} | {tracemalloc.get_traced_memory()[0] / 2**20:.2f} | "
              f"{(time.perf_counter() - t) / step * 1e6:.0f} |", flush=True)
    grown = me.memory_info().rss - rss0
    print(f"\nRSS grew {grown / 2**20:.1f} MiB over {calls} calls: {grown / calls:.0f} bytes per call "
          f"({time.perf_counter() - start:.0f} s)")
    await procs.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--payload", type=int, default=100, help="bytes sent with each call")
    ap.add_argument("--mode", choices=("call_one", "replies"), default="call_one")
    args = ap.parse_args()
    print(f"mode {args.mode}")
    asyncio.run(measure(args.calls, args.payload, args.mode))


if __name__ == "__main__":
    main()
