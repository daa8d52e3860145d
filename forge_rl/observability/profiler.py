"""Profiling chosen training steps with torch.profiler: a Chrome trace per rank and window, its top operators and,
on a GPU, its top kernels (which GEMM ran, on which cores: what the operators' names do not say).

    profiler = StepProfiler([3, 4], "outputs/grpo/profile", rank=0, cuda=False)
    profiler.begin(step)             # at the top of a step: starts a window when `step` is profiled and none runs
    ...                              # the step's work
    summary = profiler.end(step)     # at its bottom: the window's summary line when it ends at `step`, else None

Consecutive step numbers are one window (`[3, 4, 8]`: steps 3-4, then step 8). A window's trace goes to
`<folder>/rank{R}_step{A}-{B}.json.gz` (`rank{R}_step{A}.json.gz` for one step): gzipped Chrome trace JSON, which
Perfetto (ui.perfetto.dev) and chrome://tracing open as it is. Each step is a span named `trainer step N` in it.
Shapes and Python stacks are not recorded: both cost time and memory on every operator.
"""

import gzip
import json
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

TOP = 5  # operators named in the summary line


def windows(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive step numbers: [3, 4, 8] -> [(3, 4), (8, 8)]."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def trace_name(rank: int, first: int, last: int) -> str:
    return f"rank{rank}_step{first}.json.gz" if first == last else f"rank{rank}_step{first}-{last}.json.gz"


class StepProfiler:
    """torch.profiler over the windows of `steps`, one rank's; does nothing when `steps` is empty."""

    def __init__(self, steps: list[int], folder: str | Path, rank: int, cuda: bool) -> None:
        self.steps = set(steps)
        self.folder = Path(folder)
        self.rank = rank
        self.cuda = cuda
        self._prof: profile | None = None
        self._first = 0  # the running window's first step
        self._mark: record_function | None = None  # the running step's span in the trace

    @property
    def active(self) -> bool:
        return self._prof is not None

    def begin(self, step: int) -> None:
        """Step `step` starts: open a window when the step is profiled (a resumed run may start inside one)."""
        if step not in self.steps:
            return
        if self._mark is not None:  # the last step raised before its end(): its span closes here
            self._mark.__exit__(None, None, None)
        if self._prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
            self._prof.start()
            self._first = step
        self._mark = record_function(f"trainer step {step}")
        self._mark.__enter__()

    def end(self, step: int) -> str | None:
        """Step `step` is done: close its span; when the window ends here, write the trace and return the summary."""
        if self._prof is None:
            return None
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None
        if step + 1 in self.steps:  # the window goes on (the trace also holds what the trainer does in between)
            return None
        prof, self._prof = self._prof, None
        if self.cuda:
            torch.cuda.synchronize()  # the window's kernels finish inside it
        prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / trace_name(self.rank, self._first, step)
        prof.export_chrome_trace(str(path))  # a .gz name: torch writes it gzipped
        window = f"step {step}" if self._first == step else f"steps {self._first}-{step}"
        kernels = f"; {top_kernels(path)}" if self.cuda else ""
        return f"profile rank {self.rank} {window}, {top_operators(prof, self.cuda)}{kernels}; trace {path}"


def top_operators(prof: profile, cuda: bool, top: int = TOP) -> str:
    """The operators that took the most self time (CUDA time on a GPU, else CPU time): name, ms, share of all the
    operators' self time. Annotations (`trainer step N`) are not operators: their self time is Python's."""
    ops = [e for e in prof.key_averages() if not e.is_user_annotation and e.device_type.name == "CPU"]

    def self_us(e) -> float:  # an operator's own kernels count as its device time; kernels are not listed twice
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    total = sum(self_us(e) for e in ops)
    if total <= 0:
        return "no operators ran"
    ranked = sorted(ops, key=self_us, reverse=True)[:top]
    named = ", ".join(f"{e.key} {self_us(e) / 1e3:.2f} ms {self_us(e) / total:.0%}" for e in ranked)
    return f"self {'CUDA' if cuda else 'CPU'} time {total / 1e3:.1f} ms: {named}"


def top_kernels(trace: str | Path, top: int = TOP, width: int = 90) -> str:
    """The device kernels that took the most time in a Chrome trace (events of category "kernel"), summed by name:
    name (cut to `width` characters), ms, calls, share of all kernels' time."""
    opener = gzip.open if str(trace).endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    time_us, calls = Counter(), Counter()
    for e in events:
        if e.get("cat") == "kernel" and e.get("ph") == "X":
            time_us[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    total = sum(time_us.values())
    if total <= 0:
        return "no kernels in the trace"
    named = ", ".join(
        f"{name[:width]} {us / 1e3:.2f} ms x{calls[name]} {us / total:.0%}" for name, us in time_us.most_common(top)
    )
    return f"kernels {total / 1e3:.1f} ms: {named}"
