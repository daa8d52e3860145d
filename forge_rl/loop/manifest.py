"""A checkpoint's manifest: which run wrote it, at which step, and the size and SHA-256 of every file in it.

    write_manifest(step_dir, run_id, step)     # last, after every file of the checkpoint is written
    problem = verify(step_dir)                 # None when intact; else why not, in a few words
    owner(step_dir)                            # the run id the manifest names (None: no readable manifest)

The manifest is written into the checkpoint's temporary directory after everything else, before the rename
that makes the checkpoint complete (forge_rl/loop/checkpoint.py): a checkpoint without one was never finished,
or was damaged after. Verification reads every file again; files hash in parallel threads (hashlib releases
the GIL on large buffers), each streamed in 8 MiB chunks, so memory stays flat whatever the checkpoint's size.
"""

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 8 << 20


def write_manifest(step_dir: Path, run_id: str, step: int) -> None:
    """Record every file under `step_dir` (relative path -> bytes, sha256) with the run and step."""
    step_dir = Path(step_dir)
    files = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = _digests(step_dir, files)
    record = dict(run_id=run_id, step=step,
                  files={f: dict(bytes=(step_dir / f).stat().st_size, sha256=d) for f, d in zip(files, digests)})
    with open(step_dir / MANIFEST, "w") as fh:
        json.dump(record, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def read_manifest(step_dir: Path) -> dict | None:
    """The manifest of `step_dir`, or None when it is missing or unreadable."""
    try:
        record = json.loads((Path(step_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else None


def owner(step_dir: Path) -> str | None:
    """The id of the run that wrote `step_dir` (None: no readable manifest)."""
    record = read_manifest(step_dir)
    return record.get("run_id") if record else None


def verify(step_dir: Path) -> str | None:
    """None when every file the manifest lists is there with its size and checksum; otherwise the first
    problem found ('no manifest.json', 'missing __0_0.distcp', 'checksum mismatch in app_state.pt', ...)."""
    step_dir = Path(step_dir)
    record = read_manifest(step_dir)
    if record is None:
        state = "unreadable" if (step_dir / MANIFEST).exists() else "missing"
        return f"{MANIFEST} {state} (written only in part, or by a forge_rl without checkpoint checksums)"
    files = record["files"]
    for name, entry in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"missing {name}"
        if path.stat().st_size != entry.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry.get('bytes')}"
    names = list(files)
    for name, digest in zip(names, _digests(step_dir, names)):
        if digest != files[name].get("sha256"):
            return f"checksum mismatch in {name}"
    return None


def _digests(step_dir: Path, files: list[str]) -> list[str]:
    if not files:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(files), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda f: _sha256(step_dir / f), files))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
