"""Where a step of `make demo-tinker`'s loop goes: the RL loop of examples/tinker/rl_addition.py against a service
started as the demo starts it (configs/tinker/demo.yaml), each phase of each step timed in the client, and both
sides profiled with cProfile (the service's event loop, where HTTP, serialisation and the futures run, and the
client's thread).

    python -m benchmarks.tinker_profile [--steps 10] [--pipelined] [--top 15]

Prints the median seconds of each phase (save for sampling, sampling, forward_backward, optim_step), the steps a
minute, and the service's and the client's top functions by own time.
"""

import argparse
import importlib.util
import io
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]


def load_example():
    """examples/tinker/rl_addition.py as a module: the loop the demo runs, not a copy of it."""
    spec = importlib.util.spec_from_file_location("rl_addition", REPO / "examples/tinker/rl_addition.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_service(out: Path, config: str, overrides: list[str], profile: Path | None = None):
    """The service as `make demo-tinker` starts it (a process of its own), under cProfile when `profile` is a path;
    returns (the process, service.json's contents)."""
    env = {**os.environ, "FORGE_RL_TINKER_PROFILE": str(profile)} if profile else None
    command = [sys.executable, "-m", "apps.tinker.main", "--config", config, f"output_dir={out}"]
    log = open(out / "service.log", "w")
    proc = subprocess.Popen(command + overrides, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    while not (out / "service.json").exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the service did not start: {(out / 'service.log').read_text()[-2000:]}")
        time.sleep(0.5)
    time.sleep(0.2)
    return proc, json.loads((out / "service.json").read_text())


def stop_service(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def top(stats: pstats.Stats, n: int) -> str:
    buffer = io.StringIO()
    stats.stream = buffer
    stats.sort_stats("tottime").print_stats(n)
    return "\n".join(line for line in buffer.getvalue().splitlines() if line.strip())[-6000:]


def timed_steps(example, info: dict, steps: int, pipelined: bool) -> list[dict]:
    """The demo's loop for `steps` steps, each phase timed (the example's own phase timings)."""
    args = argparse.Namespace(
        base_url=info["base_url"],
        api_key=info["api_key"],
        base_model="tiny-warm",
        rank=8,
        steps=steps,
        batch=16,
        group=8,
        lr=1e-4,
        max_tokens=8,
        eval_every=10**9,
        eval_size=0,
        seed=0,
        pipelined=pipelined,
        sample_factor=1.5,
    )
    return example.train(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pipelined", action="store_true", help="the loop's --pipelined form")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    import cProfile

    example = load_example()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        proc, info = start_service(out, "configs/tinker/demo.yaml", [], profile=out / "service.prof")
        client = cProfile.Profile()
        try:
            client.enable()
            records = timed_steps(example, info, args.steps, args.pipelined)
            client.disable()
        finally:
            stop_service(proc)
        service_stats = pstats.Stats(str(out / "service.prof"))
    steps = [r for r in records if "reward" in r][1:]  # the first step warms up; the last only saves
    table = Table(title=f"demo-tinker loop, {len(steps)} steps (medians)")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for phase in dict.fromkeys(p for r in steps for p in r["phases"]):
        table.add_row(phase, f"{statistics.median(r['phases'].get(phase, 0.0) for r in steps):.3f}")
    per_step = statistics.median(b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:]))
    table.add_row("step", f"{per_step:.3f}")
    Console().print(table)
    print(f"{60 / per_step:.1f} steps/min")
    print("the service's top functions by own time:\n" + top(service_stats, args.top))
    print("the client's top functions by own time:\n" + top(pstats.Stats(client), args.top))


if __name__ == "__main__":
    main()
