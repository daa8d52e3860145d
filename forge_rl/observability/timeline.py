"""Where a run's time went: each role's busy spans, written as a Chrome trace (Perfetto, chrome://tracing) and a PNG.

    timeline = Timeline()
    with timeline.span("trainer", "train + publish", step=5):
        ...
    timeline.mark(f"step 5")
    timeline.write(out_dir)      # out_dir/timeline.json and out_dir/timeline.png

A lane is one role, or one rollout task: what it did when. A gap in a lane is that role idle. `busy_fractions()`
says per lane how much of the run it was busy, the figure the summary keeps.
"""

import contextlib
import contextvars
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

TRACE = "timeline.json"
PNG = "timeline.png"
CRITICAL_PATH = "step (critical path)"  # the lane of each step's parts (forge_rl/observability/step_time.py)

# The lane of the rollout task running in this asyncio task (RolloutTasks sets it), so that a rollout's phases
# (generate, reward, buffer) land on it without the rollout code knowing about timelines.
_ROLLOUT_LANE: contextvars.ContextVar[tuple["Timeline", str] | None] = contextvars.ContextVar(
    "rollout_lane", default=None
)


@dataclass
class Span:
    lane: str
    name: str
    start: float  # seconds since the timeline began
    end: float
    args: dict = field(default_factory=dict)


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.spans: list[Span] = []
        self.marks: list[tuple[float, str]] = []
        self.counters: list[tuple[float, str, float]] = []  # (time, name, value): a quantity read now and then
        self.open: dict[int, Span] = {}  # spans whose block is still running, by id (see spans_during)
        self._written: tuple | None = None  # (folder, spans, marks, counters) at the last write: see write

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args):
        """A busy span of `lane` for the block (recorded even when the block raises: the time was spent)."""
        span = Span(lane, name, self.now(), 0.0, args)
        self.open[id(span)] = span
        try:
            yield
        finally:
            del self.open[id(span)]
            span.end = self.now()
            self.spans.append(span)

    def spans_during(self, start: float, end: float, since: int = 0) -> list[Span]:
        """Spans that overlap [start, end], clipped to it, those still running included (as running to `end`).
        `since`: len(self.spans) taken at or before `start` (a span is appended when it ends, so one that
        overlaps the window is never before it), to skip the run's history."""
        candidates = [*self.spans[since:], *(Span(s.lane, s.name, s.start, end, s.args) for s in self.open.values())]
        return [
            Span(s.lane, s.name, max(s.start, start), min(s.end, end), s.args)
            for s in candidates
            if s.end > start and s.start < end
        ]

    def mark(self, name: str) -> None:
        """An instant on every lane: a step's end, an evaluation."""
        self.marks.append((self.now(), name))

    def counter(self, name: str, value: float) -> None:
        """A reading of `name` (a share of time busy, a queue's length) at this moment; the plot draws each counter
        as a row of its own, the trace as a counter track."""
        self.counters.append((self.now(), name, value))

    def lanes(self) -> list[str]:
        """Lanes in order of first appearance, rollout tasks last."""
        seen = list(dict.fromkeys(s.lane for s in self.spans))
        return sorted(seen, key=lambda lane: (lane.startswith("rollout"), seen.index(lane)))

    def busy_fractions(self) -> dict[str, float]:
        """Per lane, the fraction of the timeline so far during which it was busy (overlapping spans counted once)."""
        total = max(self.now(), 1e-9)
        out = {}
        for lane in self.lanes():
            busy, reach = 0.0, 0.0
            for s in sorted((s for s in self.spans if s.lane == lane), key=lambda s: s.start):
                busy += max(0.0, s.end - max(s.start, reach))
                reach = max(reach, s.end)
            out[lane] = busy / total
        return out

    def role_busy_fractions(self) -> dict[str, float]:
        """busy_fractions with the rollout tasks' lanes as one mean, "rollout tasks" (what the summary shows); the
        critical path's lane is not a role (it is busy whenever a step runs) and is left out."""
        lanes = self.busy_fractions()
        lanes.pop(CRITICAL_PATH, None)
        rollouts = [f for lane, f in lanes.items() if lane.startswith("rollout")]
        out = {lane: f for lane, f in lanes.items() if not lane.startswith("rollout")}
        if rollouts:
            out["rollout tasks"] = sum(rollouts) / len(rollouts)
        return out

    def chrome_trace(self) -> dict:
        """The Trace Event Format: one thread per lane, complete events in microseconds."""
        tids = {lane: i for i, lane in enumerate(self.lanes())}
        events = [
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": lane}}
            for lane, tid in tids.items()
        ]
        events += [
            {
                "ph": "X",
                "name": s.name,
                "pid": 0,
                "tid": tids[s.lane],
                "ts": round(s.start * 1e6, 1),
                "dur": round((s.end - s.start) * 1e6, 1),
                "args": s.args,
            }
            for s in self.spans
        ]
        events += [
            {"ph": "i", "s": "g", "name": name, "pid": 0, "tid": 0, "ts": round(t * 1e6, 1)} for t, name in self.marks
        ]
        events += [
            {"ph": "C", "name": name, "pid": 0, "ts": round(t * 1e6, 1), "args": {name: value}}
            for t, name, value in self.counters
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """The trace and its plot in `out_dir`. A run writes them when it finishes and again when it stops (so an
        interrupted run has them too): drawing is a second of CPU, so files that already show every span are kept."""
        out = Path(out_dir)
        trace, png = out / TRACE, out / PNG
        state = (out.resolve(), len(self.spans), len(self.marks), len(self.counters))
        if state == self._written and trace.is_file() and png.is_file():
            return trace, png
        trace.write_text(json.dumps(self.chrome_trace()))
        plot_timeline(self, png)
        self._written = state
        return trace, png


@contextlib.contextmanager
def rollout_lane(timeline: "Timeline", lane: str):
    """The block is rollout task `lane`'s: `phase` spans inside it (this asyncio task's) go on that lane."""
    token = _ROLLOUT_LANE.set((timeline, lane))
    try:
        with timeline.span(lane, "rollout"):
            yield
    finally:
        _ROLLOUT_LANE.reset(token)


@contextlib.contextmanager
def phase(name: str):
    """A phase of the rollout running in this asyncio task (generate, reward, buffer), a span on its lane; nothing
    outside a rollout task (an evaluation, a test calling the rollout directly)."""
    where = _ROLLOUT_LANE.get()
    if where is None:
        yield
        return
    timeline, lane = where
    with timeline.span(lane, name):
        yield


def plot_timeline(timeline: Timeline, out_png: str | Path, title: str = "") -> Path:
    """One row per lane, a bar per span coloured by what it was; steps as thin vertical lines. Counters first, a
    row each, their readings as a filled step curve scaled to the row (its label says the largest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counters = {name: [(t, v) for t, n, v in timeline.counters if n == name] for _, name, _ in timeline.counters}
    labels = [f"{name} (max {max(v for _, v in readings):.2g})" for name, readings in counters.items()]
    labels += timeline.lanes()
    names = list(dict.fromkeys(s.name for s in timeline.spans))
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.35 * max(len(labels), 1)))
    for row, readings in enumerate(counters.values()):  # the y axis is inverted: a row's foot is row + 0.4
        top = max(max(v for _, v in readings), 1e-9)
        heights = [row + 0.4 - 0.8 * v / top for _, v in readings]
        ax.fill_between([t for t, _ in readings], heights, row + 0.4, step="pre", color="black", alpha=0.35)
    for row, lane in enumerate(timeline.lanes(), start=len(counters)):
        for name in names:
            bars = [(s.start, s.end - s.start) for s in timeline.spans if s.lane == lane and s.name == name]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colours[name], linewidth=0)
    for t, name in timeline.marks:
        if name.startswith("step"):
            ax.axvline(t, color="grey", linewidth=0.3, alpha=0.5)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    ax.legend(
        handles=[matplotlib.patches.Patch(color=c, label=n) for n, c in colours.items()],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    ax.set_title(title or "what each role did when (gaps: idle)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)
