"""Start-up: how long a GRPO run takes from the command to its first step, against vLLM alone starting an engine.

    .venv/bin/python -m benchmarks.startup [--rounds 2]

forge_rl: `python -m apps.grpo.main --config configs/grpo/tiny.yaml steps=1 eval_every=0 eval_size=0`, timed to
the line of step 1 and to its exit, with the CPU seconds of every process of the run (sampled every 0.2 s; a
process that lives less than that is missed). Before its first step a run starts its controller, checks its
config and prompts, spawns its roles (trainer, generator, buffer, reward, dataset) and the generator's engine.
vLLM alone: a fresh interpreter builds `vllm.LLM` on the same model with the same engine arguments and generates
one completion, set up to start as fast as it can (the model in that one process: V1 multiprocessing off, the "uni"
executor): the engine start no GRPO run can skip, the floor. The sides alternate, `rounds` each.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil
from rich.console import Console
from rich.table import Table

from forge_rl.actors.generator_engine import CPU_ENGINE_DEFAULTS, ENGINE_DEFAULTS
from forge_rl.models import resolve_model_path

VLLM_ALONE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], **eval(sys.argv[2]))
out = llm.generate(["<|im_start|>user\\n12+34=<|im_end|>\\n<|im_start|>assistant\\n"], SamplingParams(max_tokens=8))
print("FIRST OUTPUT", flush=True)
"""


def timed(cmd: list[str], marker: str, env: dict | None = None) -> dict:
    """Run `cmd`; seconds to the first stdout line containing `marker`, to exit, and CPU over its processes."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env
    )
    cpu: dict[int, float] = {}
    done = threading.Event()

    def sample():
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                for p in [root, *root.children(recursive=True)]:
                    t = p.cpu_times()
                    cpu[p.pid] = t.user + t.system
            except psutil.Error:
                pass
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    first, tail = None, []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if first is None and marker in line:
            first = time.perf_counter() - start
    proc.wait()
    done.set()
    sampler.join()
    if proc.returncode != 0 or first is None:
        sys.exit(f"{' '.join(cmd[:4])} ... exited {proc.returncode} before '{marker}':\n{''.join(tail)}")
    return dict(first=first, total=time.perf_counter() - start, cpu=sum(cpu.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = str(resolve_model_path("tiny-warm"))
    engine_args = {**CPU_ENGINE_DEFAULTS, **ENGINE_DEFAULTS, "distributed_executor_backend": "uni"}
    in_process = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runs: dict[str, list[dict]] = {"forge_rl GRPO, 1 step": [], "vLLM alone, 1 completion": []}
    with tempfile.TemporaryDirectory() as out:
        grpo = [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo/tiny.yaml", "steps=1"]
        grpo += ["eval_every=0", "eval_size=0", f"output_dir={out}", "overwrite=true"]
        for r in range(args.rounds):
            runs["forge_rl GRPO, 1 step"].append(timed(grpo, "step    1 |"))
            runs["vLLM alone, 1 completion"].append(
                timed([sys.executable, "-c", VLLM_ALONE, model, repr(engine_args)], "FIRST OUTPUT", in_process)
            )
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    table = Table(title=f"start-up, tiny-warm on CPU, median of {args.rounds} (sides alternating)")
    for col in ("", "to first step / output (s)", "to exit (s)", "CPU, all processes (s)"):
        table.add_column(col)
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("first", "total", "cpu")}
        table.add_row(name, f"{med['first']:.1f}", f"{med['total']:.1f}", f"{med['cpu']:.1f}")
    Console().print(table)
    ours, floor = (statistics.median(r["first"] for r in rs) for rs in runs.values())
    print(f"forge_rl's first step comes {ours / floor:.2f}x vLLM alone's first output ({ours - floor:.1f} s later)")


if __name__ == "__main__":
    main()
