"""Chaos: a short seeded synchronous GRPO run, SIGKILLed at a moment nobody chose, then resumed until it completes.

    .venv/bin/python -m benchmarks.chaos --trials 50 [--steps 6] [--seed 0] [--out outputs/chaos]
        [--roles engine reward ...] [--moments start-up ...] [-- key=value ...]

First one uninterrupted run of the same command: its wall time bounds the random moments, and its final weights are
what every trial must end with. Then each trial runs `python -m apps.grpo.main` as a user would, in its own process,
and SIGKILLs one process of the run chosen at random (the controller, the trainer, the generator or its vLLM
engine, the replay buffer, the reward actor, the dataset) at a moment chosen at random: any time in the run, during
start-up (before the first step), while a checkpoint is being written (its `.partial` folder exists), during the
first evaluation (the one that prints a line as it starts), during its finish (the last checkpoint written, the
last evaluation, export and summary.json to come), or after the run said `done` (its exit). A role whose
process does not exist yet at the moment is waited for (the trial kills nothing if the run ends first); at the
exit, a role already gone is replaced by the controller.
Then it reruns the same command with `resume=auto` until the run completes (at most --max-resumes times), and
checks, per trial:

- completed: a run reached `steps`;
- steps re-done: steps trained before the kill and trained again after it (those past the last checkpoint);
- steps lost: the newest complete checkpoint at the kill minus the step the resume started from (must be 0);
- checkpoints passed over: those the resume found damaged and skipped (each one named by the run);
- processes left and /dev/shm entries left after the trial's last run exits (must be 0);
- half-written checkpoint folders left (`.partial`, must be 0 once the run has saved that step again);
- bug lines: the killed run said "a bug in forge_rl" where it should name the role that died (must be 0);
- same weights: the final model equals the uninterrupted run's, bit for bit (seeded, synchronous, fp32 on CPU).

Prints a line per trial and the table at the end; writes chaos.json and chaos.md in --out.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from safetensors.torch import load_file

from forge_rl.loop.checkpoint import complete_checkpoints
from tests.support.run_processes import left_alive, process_ids
from tests.support.run_shm import RunShm
from tests.support.seeded_sync import SEEDED_SYNC

REPO = Path(__file__).resolve().parents[1]
# synchronous and seeded: the resumed run must end with the uninterrupted run's weights; a checkpoint every 2 steps
# and an evaluation in the middle, so that each moment exists
CAMPAIGN = [*SEEDED_SYNC, "checkpoint_every=2", "eval_size=20"]
# the role each process plays, by the start of the name the provisioner (forge:<Role>) or vLLM gives it
ROLES = {
    "forge:Trainer": "trainer",
    "forge:Generator": "generator",
    "VLLM::EngineCor": "engine",
    "forge:ReplayBuf": "buffer",
    "forge:RewardAct": "reward",
    "forge:PromptDat": "dataset",
}
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the run's lines reach its log as it prints them: moments are read there
BUG = "This is a bug in forge_rl"  # how the apps' line for an unforeseen error reads (forge_rl/recipes/command_line.py)
MOMENTS = ("any time", "start-up", "checkpoint write", "evaluation", "finish", "exit")


def command(out: Path, steps: int, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "apps.grpo.main",
        "--config",
        "configs/grpo/tiny.yaml",
        f"output_dir={out}",
        f"steps={steps}",
        f"eval_every={max(1, steps // 2)}",
        *CAMPAIGN,
        *overrides,
    ]


def processes(app: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The run's processes by role: the controller (the app itself) and its descendants that have a role."""
    found: dict[str, list[psutil.Process]] = {"controller": [app]}
    try:
        children = app.children(recursive=True)
    except psutil.Error:
        return found
    for proc in children:
        try:
            name = proc.name()  # psutil completes a 15-character name from the command line: VLLM::EngineCore
            role = next((r for prefix, r in ROLES.items() if name.startswith(prefix)), None)
        except psutil.Error:
            continue
        if role:
            found.setdefault(role, []).append(proc)
    return found


def moment_reached(moment: str, log: Path, out: Path, steps: int, deadline: float, started: float) -> bool:
    """Whether the run is at `moment` now (`deadline`: the random time for "any time" and "start-up")."""
    text = log.read_text(errors="replace") if log.exists() else ""
    now = time.monotonic() - started
    if moment == "any time":
        return now >= deadline
    if moment == "start-up":
        return now >= deadline or "step    1 |" in text
    if moment == "checkpoint write":
        return any((out / "checkpoints").glob(".step-*.partial"))
    if moment == "evaluation":  # the line the run prints as an evaluation starts, not yet followed by its result
        return text.rstrip().splitlines()[-1:] != [] and text.rstrip().splitlines()[-1].startswith("evaluating step")
    if moment == "finish":  # the last checkpoint written, the last evaluation, export and summary.json not yet
        return (out / "checkpoints" / f"step-{steps}").is_dir() and "\ndone\n" not in text
    return "\ndone\n" in text  # exit: the summary printed, the run stopping its processes


def run_until_killed(cmd, out, log, steps, role, moment, deadline, shm: RunShm, seen: set):
    """Start the run; SIGKILL one `role` process at `moment`. Returns (what was killed, when, newest checkpoint then)
    or None when the run ended before the moment came."""
    started = time.monotonic()
    with log.open("w") as f:
        app = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=ENV)
    root = psutil.Process(app.pid)
    killed, looked = None, 0.0
    while app.poll() is None:
        if time.monotonic() - looked > 0.5:  # reading every process's maps takes a while: not at every poll
            shm.see(root)
            seen.update(process_ids(root))
            looked = time.monotonic()
        if killed is None and moment_reached(moment, log, out, steps, deadline, started):
            candidates = processes(root).get(role, [])
            # a role whose process does not exist yet (an engine early in start-up) is waited for; only at the exit,
            # where the roles' processes are going away, is the app killed in its place
            if candidates or moment == "exit":
                victim = candidates[0] if candidates else root
                saved = complete_checkpoints(out / "checkpoints")
                try:
                    victim.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
                killed = dict(
                    role=role if candidates else "controller",
                    at_s=round(time.monotonic() - started, 1),
                    newest_checkpoint=int(saved[-1].name.split("-")[1]) if saved else 0,
                    step=last_step(out),
                )
        time.sleep(0.02)  # a checkpoint's .partial folder lives for a fraction of a second on the tiny model
    if killed is None:
        return None, app.returncode
    try:
        app.wait(timeout=120)  # a killed role: the controller stops the run by itself (its one line)
    except subprocess.TimeoutExpired:
        app.kill()
    return killed, app.returncode


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if '"trainer/loss"' in line]
    return max(steps, default=0)


def final_weights(out: Path) -> dict:
    return load_file(next((out / "hf").glob("*.safetensors")))


def trial(n: int, rng: random.Random, args, reference: dict, ref_wall: float) -> dict:
    out = Path(args.out) / f"trial-{n:03d}"
    shm, seen = RunShm(), set()
    role = rng.choice(args.roles)
    moment = rng.choice(args.moments)
    deadline = rng.uniform(0, ref_wall if moment == "any time" else ref_wall * 0.6)
    cmd = command(out, args.steps, ["overwrite=true", *args.overrides])
    killed_log = out.parent / f"trial-{n:03d}.log"
    killed, code = run_until_killed(cmd, out, killed_log, args.steps, role, moment, deadline, shm, seen)
    if not out.exists():
        out.mkdir(parents=True)
    resumes, passed_over, started_from, codes = 0, [], None, [code]
    while not (out / "summary.json").exists() or last_step(out) < args.steps:
        if resumes >= args.max_resumes:
            break
        resumes += 1
        log = out.parent / f"trial-{n:03d}.resume{resumes}.log"
        with log.open("w") as f:
            app = subprocess.Popen(
                command(out, args.steps, ["resume=auto", *args.overrides]),
                cwd=REPO,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=ENV,
            )
            root = psutil.Process(app.pid)
            while app.poll() is None:
                shm.see(root)
                seen.update(process_ids(root))
                time.sleep(0.2)
            codes.append(app.returncode)
        text = log.read_text(errors="replace")
        passed_over += [line for line in text.splitlines() if "passed over" in line]
        if started_from is None:
            started_from = (
                json.loads((out / "summary.json").read_text())["start_step"]
                if (out / "summary.json").exists()
                else None
            )
    left = left_alive(seen)
    done = (out / "summary.json").exists() and last_step(out) >= args.steps
    same = done and (out / "hf").exists() and _equal(final_weights(out), reference)
    redone = lost = None
    if killed is not None and started_from is not None:
        redone = max(0, killed["step"] - started_from)
        lost = max(0, killed["newest_checkpoint"] - started_from)
    return dict(
        trial=n,
        role=killed["role"] if killed else role,
        moment=moment,
        killed=killed,
        exit_codes=codes,
        resumes=resumes,
        completed=done,
        resumed_from=started_from,
        steps_redone=redone,
        steps_lost=lost,
        checkpoints_passed_over=len(passed_over),
        processes_left=left,
        shm_left=shm.left(),
        partial_left=[p.name for p in (out / "checkpoints").glob(".step-*.partial")],
        # a killed role is named in the run's one line, never reported as a bug in forge_rl
        bug_lines=[line for line in killed_log.read_text(errors="replace").splitlines() if BUG in line],
        same_weights=same,
    )


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def table(trials: list[dict]) -> str:
    killed = [t for t in trials if t["killed"]]
    covered = sorted({(t["role"], t["moment"]) for t in killed})
    rows = [
        ("trials", len(trials)),
        ("kills (a trial whose run ended before its moment kills nothing)", len(killed)),
        ("roles killed", ", ".join(sorted({t["role"] for t in killed}))),
        ("moments hit", ", ".join(m for m in MOMENTS if any(t["moment"] == m for t in killed))),
        ("(role, moment) pairs covered", len(covered)),
        ("runs completed", sum(t["completed"] for t in trials)),
        ("steps re-done (all trials)", sum(t["steps_redone"] or 0 for t in trials)),
        ("steps lost past the last checkpoint", sum(t["steps_lost"] or 0 for t in trials)),
        ("checkpoints that failed verification (passed over)", sum(t["checkpoints_passed_over"] for t in trials)),
        ("processes left after a trial", sum(len(t["processes_left"]) for t in trials)),
        ("shared-memory entries left after a trial", sum(len(t["shm_left"]) for t in trials)),
        ("half-written checkpoint folders left", sum(len(t["partial_left"]) for t in trials)),
        (
            "killed runs that said 'a bug in forge_rl' instead of naming the role",
            sum(bool(t["bug_lines"]) for t in trials),
        ),
        (
            "final weights equal to the uninterrupted run's",
            f"{sum(t['same_weights'] for t in trials)} of {len(trials)}",
        ),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0, help="the campaign's choices of role and moment")
    roles = ["controller", *ROLES.values()]
    ap.add_argument("--roles", nargs="+", choices=roles, default=roles, help="draw the victim among these only")
    ap.add_argument("--moments", nargs="+", choices=MOMENTS, default=list(MOMENTS), help="and the moment so")
    ap.add_argument("--max-resumes", type=int, default=3)
    ap.add_argument("--out", default="outputs/chaos")
    ap.add_argument("overrides", nargs="*", help="apps.grpo.main overrides")
    args = ap.parse_args()
    base = Path(args.out)
    base.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ref = subprocess.run(
        command(base / "uninterrupted", args.steps, ["overwrite=true", *args.overrides]),
        cwd=REPO,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    ref_wall = time.monotonic() - started
    if ref.returncode != 0:
        raise SystemExit(f"chaos: the uninterrupted run failed ({ref.returncode}): {ref.stderr[-2000:]}")
    reference = final_weights(base / "uninterrupted")
    print(f"uninterrupted run: {ref_wall:.0f} s; {args.trials} trials follow", flush=True)
    rng, trials = random.Random(args.seed), []
    for n in range(1, args.trials + 1):
        t = trial(n, rng, args, reference, ref_wall)
        trials.append(t)
        k = t["killed"]
        print(
            f"trial {n}/{args.trials}: {t['role']} killed at {t['moment']}"
            + (f" ({k['at_s']} s, step {k['step']}, newest checkpoint {k['newest_checkpoint']})" if k else " (never)")
            + f"; {t['resumes']} resume(s) from {t['resumed_from']}; completed {t['completed']}, lost "
            f"{t['steps_lost']}, left {len(t['processes_left'])} procs / {len(t['shm_left'])} shm, "
            f"same weights {t['same_weights']}",
            flush=True,
        )
        (base / "chaos.json").write_text(json.dumps(trials, indent=1))
    md = table(trials)
    (base / "chaos.md").write_text(md + "\n")
    print("\n" + md)


if __name__ == "__main__":
    main()
