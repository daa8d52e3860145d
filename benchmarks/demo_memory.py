"""Peak memory of a whole run, all processes together (controller, Monarch procs, vLLM engine and workers).

    .venv/bin/python -m benchmarks.demo_memory [-- command ...]     # default: the `make demo` command

Samples the summed RSS of the command's process tree every 0.2 s and prints the peak and the wall time.
RSS counts pages shared between processes once per process, so the figure is an upper bound.
"""

import subprocess
import sys
import time

import psutil

DEFAULT = [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo/tiny.yaml"]


def tree_rss(root: psutil.Process) -> int:
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> None:
    command = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else DEFAULT
    start = time.perf_counter()
    proc = subprocess.Popen(command)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(root))
        time.sleep(0.2)
    print(f"command: {' '.join(command)}")
    print(f"exit code {proc.returncode}; wall {time.perf_counter() - start:.0f} s; "
          f"peak RSS of all processes {peak / 2**30:.2f} GiB")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
