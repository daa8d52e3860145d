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
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

TRACE = "timeline.json"
PNG = "timeline.png"


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

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args):
        """A busy span of `lane` for the block (recorded even when the block raises: the time was spent)."""
        start = self.now()
        try:
            yield
        finally:
            self.spans.append(Span(lane, name, start, self.now(), args))

    def mark(self, name: str) -> None:
        """An instant on every lane: a step's end, an evaluation."""
        self.marks.append((self.now(), name))

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
        """busy_fractions with the rollout tasks' lanes as one mean, "rollout tasks" (what the summary shows)."""
        lanes = self.busy_fractions()
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
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        out = Path(out_dir)
        trace = out / TRACE
        trace.write_text(json.dumps(self.chrome_trace()))
        return trace, plot_timeline(self, out / PNG)


def plot_timeline(timeline: Timeline, out_png: str | Path, title: str = "") -> Path:
    """One row per lane, a bar per span coloured by what it was; steps as thin vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = timeline.lanes()
    names = list(dict.fromkeys(s.name for s in timeline.spans))
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.35 * max(len(lanes), 1)))
    for row, lane in enumerate(lanes):
        for name in names:
            bars = [(s.start, s.end - s.start) for s in timeline.spans if s.lane == lane and s.name == name]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colours[name], linewidth=0)
    for t, name in timeline.marks:
        if name.startswith("step"):
            ax.axvline(t, color="grey", linewidth=0.3, alpha=0.5)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
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
