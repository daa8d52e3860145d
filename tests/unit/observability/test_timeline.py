"""The run's timeline: busy spans per lane, the Chrome trace Perfetto opens, the PNG."""

import json
import time

from forge_rl.observability.timeline import Timeline


def test_spans_make_lanes_busy_fractions_and_a_chrome_trace(tmp_path):
    timeline = Timeline()
    with timeline.span("trainer", "train + publish", step=1):
        time.sleep(0.05)
    lasted = []
    for i in range(2):  # overlapping rollouts on two lanes, and twice on one: counted once
        start = time.perf_counter()
        with timeline.span(f"rollout {i}", "rollout"), timeline.span(f"rollout {i}", "rollout"):
            time.sleep(0.02)
        lasted.append(time.perf_counter() - start)
    try:
        with timeline.span("weight swaps", "weight swap"):
            raise RuntimeError("a failed swap still took its time")
    except RuntimeError:
        pass
    timeline.mark("step 1")
    time.sleep(0.05)
    assert timeline.lanes() == ["trainer", "weight swaps", "rollout 0", "rollout 1"]
    busy = timeline.busy_fractions()
    total = timeline.now()
    assert 0.05 / total <= busy["trainer"] < 0.9 and busy["weight swaps"] < 0.05
    # the nested span is not counted twice: at most the time the outer one lasted (twice would be about double)
    assert 0.02 <= busy["rollout 0"] * total <= 1.01 * lasted[0] + 1e-3, (busy, total, lasted)
    roles = timeline.role_busy_fractions()
    assert set(roles) == {"trainer", "weight swaps", "rollout tasks"}
    trace, png = timeline.write(tmp_path)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"trainer", "weight swaps", "rollout 0", "rollout 1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6 and all(e["dur"] >= 0 for e in spans)
    assert [e["args"] for e in spans if e["name"] == "train + publish"] == [{"step": 1}]
    assert png.stat().st_size > 5_000


def test_writing_again_redraws_only_what_changed(tmp_path):
    """A run writes its timeline when it finishes and again when it stops: the second write keeps files that
    already show every span, and redraws once a span, a mark or the folder is new."""
    timeline = Timeline()
    with timeline.span("trainer", "train + publish"):
        pass
    trace, png = timeline.write(tmp_path)
    drawn = (trace.stat().st_mtime_ns, png.stat().st_mtime_ns)
    time.sleep(0.01)
    assert timeline.write(tmp_path) == (trace, png)
    assert (trace.stat().st_mtime_ns, png.stat().st_mtime_ns) == drawn
    with timeline.span("weight swaps", "weight swap"):
        pass
    timeline.write(tmp_path)
    assert png.stat().st_mtime_ns > drawn[1]
    assert {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"} == {
        "train + publish",
        "weight swap",
    }
    png.unlink()  # a file gone is written again
    timeline.write(tmp_path)
    assert png.is_file()
    (tmp_path / "other").mkdir()
    other, _ = timeline.write(tmp_path / "other")  # another folder is written to
    assert other.is_file()


def test_a_counter_is_a_track_of_the_trace_and_a_row_of_the_plot(tmp_path):
    """The generators' busy share is read once a step and drawn above the lanes: a role whose work the controller
    does not time (an agent gateway's calls) still shows when the engines were busy."""
    timeline = Timeline()
    with timeline.span("trainer", "train + publish"):
        timeline.counter("generators busy", 0.25)
    timeline.counter("generators busy", 0.9)
    trace, png = timeline.write(tmp_path)
    drawn = png.stat().st_mtime_ns
    counters = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "C"]
    assert [e["args"] for e in counters] == [{"generators busy": 0.25}, {"generators busy": 0.9}]
    assert counters[0]["ts"] <= counters[1]["ts"]
    time.sleep(0.01)
    timeline.counter("generators busy", 0.5)  # a new reading redraws
    timeline.write(tmp_path)
    assert png.stat().st_mtime_ns > drawn and png.stat().st_size > 5_000
