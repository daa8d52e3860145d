"""Where one training step's wall time went on its critical path: the parts the step waited for, one after the
other, and the controller's own work between them as the remainder, so the parts sum to the step's wall time.

    clock = StepClock(timeline, step=5)
    with clock.waiting_for_samples():       # split by what the rollout tasks did meanwhile (see below)
        batches = await sample(...)
    with clock.part("train"):
        await trainer_step(...)
    line.update(clock.finish())    # {"step_time/train": ..., "step_time/controller": ..., "step_time/wall": ...}

Waiting for a batch is split by what the rollout tasks were doing while the step waited: generating (any task in
its generate phase), else scoring (reward), else putting a group in the buffer (buffer), else nothing a rollout
phase accounts for (wait: admission, the dataset, the sample calls' round trips). Each part is also a span on the
timeline's critical-path lane, so the trace shows the step as the metrics line adds it up.
"""

import contextlib

from forge_rl.observability.timeline import CRITICAL_PATH, Span, Timeline

PARTS = ("generation", "reward", "buffer", "wait", "reference", "train", "publish", "swap")
ROLLOUT_PHASES = (("generate", "generation"), ("reward", "reward"), ("buffer", "buffer"))  # highest priority first
PREFIX = "step_time/"


class StepClock:
    """The critical-path parts of one step, timed on `timeline`'s clock (so its spans and the parts agree)."""

    def __init__(self, timeline: Timeline, step: int):
        self.timeline, self.step = timeline, step
        self.start = timeline.now()
        self.parts = dict.fromkeys(PARTS, 0.0)
        self._in_part = False

    @contextlib.contextmanager
    def part(self, name: str):
        """The block is on the critical path as `name` (one of PARTS). Parts do not nest: each second counts once."""
        if name not in self.parts:
            raise ValueError(f"StepClock.part: {name!r} is not one of {PARTS}")
        if self._in_part:
            raise RuntimeError(f"StepClock.part({name!r}) inside another part: a second would count twice")
        self._in_part = True
        with self.timeline.span(CRITICAL_PATH, name, step=self.step):
            start = self.timeline.now()
            try:
                yield
            finally:
                self.parts[name] += self.timeline.now() - start
                self._in_part = False

    def reassign(self, seconds: float, from_part: str, to_part: str) -> None:
        """`seconds` of what `from_part` timed were `to_part`'s: a call that did both, and said how long the second
        took (the trainer's step and its publish)."""
        seconds = min(seconds, self.parts[from_part])
        self.parts[from_part] -= seconds
        self.parts[to_part] += seconds

    @contextlib.contextmanager
    def waiting_for_samples(self):
        """The block waits for the rollout tasks: its time is split into generation, reward, buffer and wait."""
        if self._in_part:
            raise RuntimeError("StepClock.waiting_for_samples inside another part: a second would count twice")
        self._in_part = True
        since, start = len(self.timeline.spans), self.timeline.now()
        try:
            yield
        finally:
            end = self.timeline.now()
            for name, (a, b) in split_window(self.timeline, start, end, since):
                self.parts[name] += b - a
                self.timeline.spans.append(Span(CRITICAL_PATH, name, a, b, {"step": self.step}))
            self._in_part = False

    def finish(self) -> dict[str, float]:
        """The step's metrics: each part, the controller's remainder and the wall time, as step_time/<part>."""
        wall = self.timeline.now() - self.start
        controller = max(0.0, wall - sum(self.parts.values()))
        return {
            **{PREFIX + k: v for k, v in self.parts.items()},
            PREFIX + "controller": controller,
            PREFIX + "wall": wall,
        }


def split_window(timeline: Timeline, start: float, end: float, since: int = 0) -> list[tuple[str, tuple[float, float]]]:
    """[start, end] cut where any rollout phase starts or ends; each piece named by the highest-priority phase
    running in it (ROLLOUT_PHASES), or "wait". Adjacent pieces of one name are merged. The pieces cover the window."""
    spans = [s for s in timeline.spans_during(start, end, since) if s.lane.startswith("rollout")]
    part_of = dict(ROLLOUT_PHASES)
    rank = {phase: i for i, (phase, _) in enumerate(ROLLOUT_PHASES)}
    phased = [(rank[s.name], s.start, s.end) for s in spans if s.name in rank]
    cuts = sorted({start, end, *(t for _, a, b in phased for t in (a, b))})
    pieces: list[tuple[str, tuple[float, float]]] = []
    for a, b in zip(cuts, cuts[1:]):
        running = [r for r, sa, sb in phased if sa <= a and sb >= b]
        name = part_of[ROLLOUT_PHASES[min(running)][0]] if running else "wait"
        if pieces and pieces[-1][0] == name:
            pieces[-1] = (name, (pieces[-1][1][0], b))
        else:
            pieces.append((name, (a, b)))
    return pieces
