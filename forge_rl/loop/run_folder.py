"""A run owns its output folder and its checkpoints.

    claim = claim_output_dir(out, checkpoint_dir, algorithm="grpo", resume=cfg.resume, overwrite=cfg.overwrite,
                             steps=cfg.steps, export_dir=cfg.export_dir)
    claim.run_id         # this run's id, recorded in out/run.json and in every checkpoint's manifest
    claim.resume_from    # the verified checkpoint to continue from (None: a fresh start)
    claim.notes          # what the run should say: checkpoints skipped and why, a run replaced

It runs before any actor starts. A fresh run in a folder that holds another run's metrics, summary or
checkpoints is refused (RunFolderError, one line naming the ways out) unless `overwrite=true`, which removes
that run's files first: its outputs, and the checkpoints whose manifest names it. Another run's checkpoints in
the same trainer.checkpoint_dir are never removed: a fresh run there is refused (its step-N would collide).
`resume` continues the folder's own run (the id in run.json) from its newest intact checkpoint, passing over
damaged ones and saying which and why, and first finishes a save that a crash stopped between its manifest and
its rename; a run already at `steps` has nothing to do (RunFinished) once its summary.json says it finished (one
stopped between its last checkpoint and its summary is finished: evaluation, export, summary), and a `steps`
below its checkpoint is refused. `resume=auto` with nothing to resume replaces the folder's run only when it
provably saved no checkpoint: its run.json names this trainer.checkpoint_dir and nothing there is its; otherwise
it refuses.
"""

import json
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge_rl.config import ConfigError
from forge_rl.runtime.manifest import newest_intact, owner, step_dirs, step_of

RUN_FILE = "run.json"
# what a run leaves in its output folder, besides checkpoints: removed by overwrite=true
RUN_OUTPUTS = (
    "metrics.jsonl",
    "summary.json",
    "curves.png",
    "loss.png",
    "timeline.json",
    "timeline.png",
    "profile",
    "eval_model",
    RUN_FILE,
)


class RunFolderError(ConfigError):
    """The output folder or the checkpoint to resume from cannot serve this run; the message says what to do."""


class RunFinished(Exception):
    """Resuming a run whose newest checkpoint is already at `steps`: there is nothing to train."""


@dataclass
class RunClaim:
    run_id: str
    resume_from: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def resume_step(self) -> int:
        return step_of(self.resume_from) if self.resume_from else 0


def claim_output_dir(
    out: Path,
    checkpoint_dir: Path,
    *,
    algorithm: str,
    resume: bool | str,
    overwrite: bool,
    steps: int,
    export_dir: str | None = None,
) -> RunClaim:
    out, checkpoint_dir = Path(out), Path(checkpoint_dir)
    writable_dir(out, "output_dir")
    writable_dir(checkpoint_dir, "trainer.checkpoint_dir")
    record = read_record(out)
    if resume in (True, "auto"):
        finish_interrupted_saves(checkpoint_dir, record.get("id"))
        claim = resume_claim(out, checkpoint_dir, record, resume, algorithm, steps)
        if claim is not None:
            record.setdefault("resumes", []).append(dict(at=_now(), step=claim.resume_step, command=_command()))
            write_record(out, record)
            return claim
    notes = []
    refuse_foreign_checkpoints(out, checkpoint_dir, record)
    held = held_by_another_run(out, checkpoint_dir, record)
    if held:
        if not overwrite and resume == "auto":
            refuse_unless_never_checkpointed(out, checkpoint_dir, record, held)
        elif not overwrite:
            where = "output_dir" if _inside(checkpoint_dir, out) else "output_dir / trainer.checkpoint_dir"
            resumable = resume is False and bool(run_checkpoints(checkpoint_dir, record.get("id")))
            ways = "continue it with resume=auto, replace it" if resumable else "replace it"
            raise RunFolderError(
                f"{where} {out} already holds {held}: {ways} with overwrite=true, or choose another output_dir"
            )
        remove_run(out, checkpoint_dir, export_dir, record.get("id"))
        notes.append(f"replaced {held} in {out} ({'overwrite=true' if overwrite else 'resume=auto, none to resume'})")
    record = dict(
        id=f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}",
        algorithm=algorithm,
        started=_now(),
        command=_command(),
        output_dir=str(out.resolve()),
        checkpoint_dir=str(checkpoint_dir.resolve()),
    )
    write_record(out, record)
    return RunClaim(record["id"], None, notes)


def refuse_unless_never_checkpointed(out: Path, checkpoint_dir: Path, record: dict, held: str) -> None:
    """resume=auto found nothing to resume: the folder's run may be replaced only if it provably saved no
    checkpoint, i.e. its run.json names this trainer.checkpoint_dir (and nothing there is its: resume_claim)."""
    recorded = record.get("checkpoint_dir")
    if not record.get("id") or not recorded:
        raise RunFolderError(
            f"resume=auto: output_dir {out} holds {held} with no {RUN_FILE} naming its "
            "trainer.checkpoint_dir, so whether it saved checkpoints cannot be told: replace it "
            "with overwrite=true, or choose another output_dir"
        )
    if Path(recorded).resolve() != checkpoint_dir.resolve():
        raise RunFolderError(
            f"resume=auto: run {record['id']} in {out} saved its checkpoints in "
            f"trainer.checkpoint_dir={recorded}, not {checkpoint_dir}: set "
            f"trainer.checkpoint_dir={recorded} to continue it, or overwrite=true to replace it"
        )


def resume_claim(
    out: Path, checkpoint_dir: Path, record: dict, resume: bool | str, algorithm: str, steps: int
) -> RunClaim | None:
    """The claim of a resumed run: the folder's run, from its newest intact checkpoint. None: resume=auto and
    the folder's run has no checkpoint (a fresh start follows)."""
    run_id = record.get("id")
    path, skipped = newest_intact(checkpoint_dir, run_id) if run_id else (None, [])
    if path is None:
        if resume is True or skipped:
            whose = f"run {run_id}" if run_id else f"a run (no {RUN_FILE} in {out})"
            why = f"; passed over {'; '.join(skipped)}" if skipped else ""
            recorded = record.get("checkpoint_dir")
            if recorded and Path(recorded).resolve() != checkpoint_dir.resolve():
                why += f" (run {run_id} saved its checkpoints in trainer.checkpoint_dir={recorded})"
            raise RunFolderError(
                f"resume={str(resume).lower()}: no intact checkpoint of {whose} under "
                f"trainer.checkpoint_dir {checkpoint_dir}{why}. Start afresh with resume=false "
                f"(plus overwrite=true to replace what is there) or choose another output_dir"
            )
        return None
    if record.get("algorithm") not in (None, algorithm):
        raise RunFolderError(
            f"output_dir {out} holds a {record['algorithm']} run ({run_id}); this is a "
            f"{algorithm} run: choose another output_dir, or overwrite=true with resume=false"
        )
    step = step_of(path)
    if step > steps:
        raise RunFolderError(
            f"steps={steps} is below run {run_id}'s checkpoint {path} (step {step}): set steps "
            f"above {step} to train on, or start a new run with overwrite=true or another output_dir"
        )
    notes = [f"resume: passed over {'; '.join(skipped)}; resuming from {path.name}"] if skipped else []
    if step == steps:
        if finished(out, steps):
            raise RunFinished(
                f"run {run_id} in {out} is complete: its checkpoint {path} is at steps={steps}, so there "
                "is nothing to train (raise steps to train further)"
            )
        # stopped (killed, out of time) after its last checkpoint and before its summary: what finish() does after
        # the checkpoint (the last evaluation, the export, summary.json) is still to do, and the resumed run does it
        notes.append(f"resume: run {run_id} stopped after its last step ({path.name}) before it finished: finishing it")
    return RunClaim(run_id, path, notes)


def finished(out: Path, steps: int) -> bool:
    """Whether the folder's run finished at `steps`: its summary.json, written last, says so."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("steps") == steps and not summary.get("interrupted")


def held_by_another_run(out: Path, checkpoint_dir: Path, record: dict) -> str:
    """What of the folder's earlier run the folders hold ('run X's checkpoints in D (step-10, step-20) and
    metrics.jsonl'); '' if none. Its checkpoints are those whose manifest names it, and those whose owner cannot
    be told in a checkpoint_dir inside output_dir (refuse_foreign_checkpoints refuses the others)."""
    found = [p.name for p in (out / "metrics.jsonl", out / "summary.json") if p.is_file() and p.stat().st_size > 0]
    steps = [p.name for p in run_checkpoints(checkpoint_dir, record.get("id"), _inside(checkpoint_dir, out))]
    if steps:
        shown = ", ".join(steps[-3:] if len(steps) <= 3 else ["...", *steps[-2:]])
        found.insert(0, f"checkpoints in {checkpoint_dir} ({shown})")
    if not found:
        return ""
    whose = f"run {record['id']}'s" if record.get("id") else "another run's"
    return f"{whose} {' and '.join(found)}"


def run_checkpoints(checkpoint_dir: Path, run_id: str | None, unowned: bool = False) -> list[Path]:
    """The step-N directories of run `run_id` (its id in their manifest), with `unowned` also those whose owner
    cannot be told (no readable manifest), oldest first."""
    return [
        p for p in step_dirs(checkpoint_dir) if (o := owner(p)) is not None and o == run_id or (unowned and o is None)
    ]


def refuse_foreign_checkpoints(out: Path, checkpoint_dir: Path, record: dict) -> None:
    """A fresh run writes step-N into trainer.checkpoint_dir: refused where another run's checkpoints are (or
    ones whose owner cannot be told, outside output_dir), which it must neither replace nor remove."""
    run_id, inside = record.get("id"), _inside(checkpoint_dir, out)
    mine = set(run_checkpoints(checkpoint_dir, run_id, unowned=inside))
    foreign = [p for p in step_dirs(checkpoint_dir) if p not in mine]
    if not foreign:
        return
    owners = sorted({owner(p) or "unknown (no readable manifest)" for p in foreign})
    shown = ", ".join(p.name for p in foreign[-3:])
    ours = f"run {run_id}'s in {out}" if run_id else f"the run in {out}"
    raise RunFolderError(
        f"trainer.checkpoint_dir {checkpoint_dir} holds checkpoints of another run than {ours} "
        f"({shown}; run {', '.join(owners)}), which this run would neither replace nor remove: "
        "choose another trainer.checkpoint_dir"
    )


def finish_interrupted_saves(checkpoint_dir: Path, run_id: str | None) -> None:
    """A save of run `run_id` stopped by a crash after its manifest but before its rename (`.step-N.<id>.partial`
    complete), or between replacing step-N and renaming the new one in (`.step-N.<id>.replaced` alone): the
    rename is done now, so that resume finds (and verifies) it."""
    if not run_id:
        return
    leftovers = sorted(Path(checkpoint_dir).glob(".step-*"), key=lambda p: not p.name.endswith(".partial"))
    for path in leftovers:
        step = path.name.split(".")[1]
        final = Path(checkpoint_dir) / step
        if path.is_dir() and step[5:].isdigit() and owner(path) == run_id and not final.exists():
            path.rename(final)


def remove_run(out: Path, checkpoint_dir: Path, export_dir: str | None, run_id: str | None) -> None:
    """overwrite=true (or resume=auto with none to resume): the replaced run's outputs, its checkpoints (finished
    or not: those whose manifest names it, or whose name does) and its export under `out`. In a
    checkpoint_dir inside `out`, also those whose owner cannot be told; another run's, never."""
    inside = _inside(checkpoint_dir, out)
    doomed = [out / name for name in RUN_OUTPUTS]
    doomed += run_checkpoints(checkpoint_dir, run_id, unowned=inside)
    for path in checkpoint_dir.glob(".step-*"):
        o = owner(path)
        if (o is not None and o == run_id) or (o is None and (inside or (run_id and f".{run_id}." in path.name))):
            doomed.append(path)
    if export_dir and _inside(Path(export_dir), out):
        doomed.append(Path(export_dir))
    for path in doomed:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _inside(path: Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def writable_dir(path: Path, key: str) -> None:
    """Create `path` if need be and check a file can be written there; RunFolderError naming `key` if not."""
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"{key}={path} is a file, not a directory: choose a directory for {key}")
    probe = path / f".forge_rl-write-test-{secrets.token_hex(4)}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunFolderError(
            f"{key}={path} cannot be written ({e.strerror or e}): choose a writable directory for {key}"
        ) from None


def read_record(out: Path) -> dict:
    """out/run.json ({} when absent or unreadable: the folder's run is then unknown)."""
    try:
        record = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_record(out: Path, record: dict) -> None:
    tmp = out / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.rename(out / RUN_FILE)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _command() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])
