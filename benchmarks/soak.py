"""Soak: a long GRPO run of the demo config with a generator replica SIGKILLed every N steps.

    .venv/bin/python -m benchmarks.soak [--steps 1000] [--kill-every 200] [--out outputs/soak] [-- key=value ...]

Runs `python -m apps.grpo.main --config configs/grpo/tiny.yaml` as a user would, in its own process, and
from outside it: kills one generator replica's proc (and so its vLLM engine) each time the run reaches a
multiple of --kill-every steps, samples the resident memory of every process of the run, and after the run
exits checks that every process it started is gone and none of the run's /dev/shm entries is left (its
forge_rl-<run>-* entries and whatever its processes mapped there: tests/support/run_shm.py; other runs on the
machine may come and go meanwhile). Prints:

- steps completed, replicas killed and respawned, and every episode accounted for
  (added == trained + dropped, the episodes still buffered at the end counted as dropped "evicted");
- drops by reason (stale among them);
- RSS per role after warm-up (the first kill's step / 2) and at the end, and the change (target: <= +10%);
- processes left alive and /dev/shm entries left behind after exit (target: none).

`soak(...)` returns the same figures as a dict (tests/integration/test_soak.py runs a short one in CI).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

from tests.support.run_processes import left_alive, process_ids
from tests.support.run_shm import RunShm

REPO = Path(__file__).resolve().parents[1]


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _role(proc: psutil.Process) -> str:
    """The provisioner names procs "forge:<Role>"; vLLM names its own; the rest is the controller's helpers."""
    try:
        name = proc.name()
        if name.startswith("python") and "apps.grpo.main" in " ".join(proc.cmdline()):
            return "controller"
        return name
    except psutil.Error:
        return "?"


def _rss_by_role(root: psutil.Process) -> dict[str, float]:
    """MiB of resident memory per role, summed over the role's processes."""
    rss: dict[str, float] = defaultdict(float)
    for proc in _tree(root):
        try:
            rss[_role(proc)] += proc.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return dict(rss)


def _last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    steps = [
        json.loads(line)["step"]
        for line in metrics.read_text().splitlines()
        if line.strip() and '"trainer/loss"' in line
    ]
    return max(steps, default=0)


def _kill_a_replica(root: psutil.Process) -> int | None:
    """SIGKILL one generator proc (the one whose child is a vLLM EngineCore); returns its pid."""
    for proc in _tree(root):
        try:
            if proc.name().startswith("forge:Generator"):
                os.kill(proc.pid, signal.SIGKILL)
                return proc.pid
        except psutil.Error:
            continue
    return None


def soak(
    steps: int,
    kill_every: int,
    out: Path,
    overrides: list[str] = (),
    sample_s: float = 2.0,
    timeout_s: float = 3 * 3600,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    shm = RunShm()
    cmd = [
        sys.executable,
        "-m",
        "apps.grpo.main",
        "--config",
        "configs/grpo/tiny.yaml",
        f"steps={steps}",
        f"output_dir={out}",
        "overwrite=true",
        "eval_every=0",
        *overrides,
    ]
    warm_step = max(1, min(kill_every // 2, steps // 2))
    rss_warm: dict[str, float] | None = None
    rss_end: dict[str, float] = {}
    kills, seen = [], set()
    series: list[tuple[int, dict[str, float]]] = []  # (step, RSS by role), every tenth of the run
    start = time.monotonic()
    with (out / "soak.log").open("w") as log:
        app = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        root = psutil.Process(app.pid)
        next_kill = kill_every
        while app.poll() is None:
            if time.monotonic() - start > timeout_s:
                app.send_signal(signal.SIGTERM)  # the app saves a checkpoint and stops
                app.wait(timeout=300)
                break
            step = _last_step(out / "metrics.jsonl")
            seen.update(process_ids(root))
            shm.see(root)
            if rss_warm is None and step >= warm_step:
                rss_warm = _rss_by_role(root)
            if step < steps:  # the end: the last sample before the run's final evaluation and exit
                rss_end = _rss_by_role(root) or rss_end
            if step and (not series or step >= series[-1][0] + max(1, steps // 10)):
                series.append((step, _rss_by_role(root)))
            if kill_every and next_kill < steps and step >= next_kill:
                victim = _kill_a_replica(root)
                if victim is not None:
                    kills.append((step, victim))
                next_kill += kill_every
            time.sleep(sample_s)
    wall = time.monotonic() - start
    alive = left_alive(seen)  # after the watchers' sweep
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    buf = summary.get("buffer", {})
    return dict(
        returncode=app.returncode,
        wall_s=wall,
        steps=summary.get("trainer_version", _last_step(out / "metrics.jsonl")),
        kills=kills,
        respawns=summary.get("generator_respawns"),
        generator_versions=summary.get("generator_versions"),
        added=buf.get("added"),
        trained=buf.get("trained"),
        dropped=buf.get("dropped", {}),
        accounted=bool(buf) and buf["added"] == buf["trained"] + sum(buf["dropped"].values()) + buf["present"],
        drops=summary.get("drops", {}),
        stale_fraction=summary.get("stale_fraction"),
        steps_per_min=summary.get("steps_per_min"),
        eval_first=summary.get("eval_first"),
        eval_last=summary["evals"][-1][2] if summary.get("evals") else None,
        rss_warm=rss_warm or {},
        rss_end=rss_end,
        rss_series=series,
        processes_seen=len(seen),
        processes_left=alive,
        shm_seen=sorted(shm.entries),
        shm_left=shm.left(),
    )


def print_report(r: dict) -> None:
    print(
        f"\nsoak: {r['steps']} steps in {r['wall_s']:.0f} s (exit code {r['returncode']}), "
        f"{len(r['kills'])} generator replicas killed at steps {[s for s, _ in r['kills']]}, "
        f"{r['respawns']} respawned; final generator versions {r['generator_versions']}"
    )
    print(
        f"episodes: added {r['added']} = trained {r['trained']} + dropped {sum(r['dropped'].values())} "
        f"({'accounted' if r['accounted'] else 'NOT ACCOUNTED'}); drops {r['drops']}; "
        f"stale {r['stale_fraction']:.2%} of generated"
        if r["added"] is not None
        else "no summary written"
    )
    if r["eval_first"] is not None:
        print(
            f"held-out accuracy {r['eval_first']:.1%} at the start -> {r['eval_last']:.1%} at the end; "
            f"{r['steps_per_min']:.1f} steps/min (replica respawns included)"
        )
    print("\n| process | RSS after warm-up (MiB) | RSS at the end (MiB) | change |\n|---|---|---|---|")
    for role in sorted(set(r["rss_warm"]) | set(r["rss_end"])):
        warm, end = r["rss_warm"].get(role), r["rss_end"].get(role)
        change = f"{(end / warm - 1):+.1%}" if warm and end else "-"
        print(f"| {role} | {warm or 0:.0f} | {end or 0:.0f} | {change} |")
    total_w, total_e = sum(r["rss_warm"].values()), sum(r["rss_end"].values())
    if total_w:
        print(f"| all | {total_w:.0f} | {total_e:.0f} | {total_e / total_w - 1:+.1%} |")
    if r["rss_series"]:
        print(
            "\ncontroller RSS (MiB) by step: "
            + ", ".join(f"{step}: {rss.get('controller', 0):.0f}" for step, rss in r["rss_series"])
        )
    print(
        f"\nafter exit: {len(r['processes_left'])} of {r['processes_seen']} processes left alive "
        f"{r['processes_left'] or ''}; /dev/shm entries left: {r['shm_left'] or 'none'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--kill-every", type=int, default=200)
    ap.add_argument("--out", default="outputs/soak")
    ap.add_argument("overrides", nargs="*", help="apps.grpo.main overrides, e.g. generator.replicas=2")
    args = ap.parse_args()
    report = soak(args.steps, args.kill_every, Path(args.out), args.overrides)
    (Path(args.out) / "soak.json").write_text(json.dumps(report, indent=2))
    print_report(report)


if __name__ == "__main__":
    main()
