"""trainer.profile_steps' profiler on a small torch computation in this process: windows of consecutive steps, a
gzipped Chrome trace per window, and a summary line that names the operators that took the time."""

import gzip
import json

import torch

from forge_rl.observability.profiler import StepProfiler, windows


def test_consecutive_steps_are_one_window():
    assert windows([8, 3, 4, 4]) == [(3, 4), (8, 8)]
    assert windows([]) == []


def test_each_window_writes_a_trace_and_names_its_top_operators(tmp_path):
    profiler = StepProfiler([2, 3, 5], tmp_path / "profile", rank=0, cuda=False)
    a = torch.randn(96, 96, requires_grad=True)
    summaries = {}
    for step in range(1, 6):
        profiler.begin(step)
        for _ in range(3):
            (a @ a).relu().sum().backward()
        summaries[step] = profiler.end(step)
    assert [s is not None for s in summaries.values()] == [False, False, True, False, True]
    assert not profiler.active
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0_step2-3.json.gz", "rank0_step5.json.gz"]
    events = json.loads(gzip.decompress((tmp_path / "profile/rank0_step2-3.json.gz").read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"trainer step 2", "trainer step 3", "aten::mm"} <= names and "trainer step 1" not in names
    line = summaries[3]
    assert line.startswith("profile rank 0 steps 2-3, self CPU time ") and "\n" not in line
    assert "aten::mm " in line and "trainer step" not in line  # operators, not the steps' annotations
    assert line.endswith(f"trace {tmp_path / 'profile/rank0_step2-3.json.gz'}")
    assert summaries[5].startswith("profile rank 0 step 5, ")


def test_no_steps_no_profiler(tmp_path):
    profiler = StepProfiler([], tmp_path, rank=1, cuda=False)
    profiler.begin(1)
    assert not profiler.active and profiler.end(1) is None and not any(tmp_path.iterdir())


def test_top_kernels_sums_a_traces_kernels_by_name(tmp_path):
    """On a GPU the summary also names the kernels (which GEMM ran, on which cores). The trace here is written as
    torch.profiler writes a CUDA one: complete events ("ph": "X") of category "kernel", durations in microseconds."""
    from forge_rl.observability.profiler import top_kernels

    def kernel(name: str, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "ts": 0}

    trace = tmp_path / "rank0_step4.json.gz"
    events = [kernel("sm80_xmma_gemm_f32f32", 300.0), kernel("sm80_xmma_gemm_f32f32", 33.0)]
    events += [kernel("cutlass_80_simt_sgemm", 160.0), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 900.0}]
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    line = top_kernels(trace)
    assert line.startswith("kernels 0.5 ms: sm80_xmma_gemm_f32f32 0.33 ms x2 68%, cutlass_80_simt_sgemm 0.16 ms x1 32%")
    assert "aten::mm" not in line  # operators are not kernels
    empty = tmp_path / "cpu.json"
    empty.write_text(json.dumps({"traceEvents": events[-1:]}))
    assert top_kernels(empty) == "no kernels in the trace"
