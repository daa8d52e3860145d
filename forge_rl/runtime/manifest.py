"""A checkpoint's manifest: which run wrote it, at which step, and the size and SHA-256 of every file in it.

    write_rank_digests(step_dir, rank)         # a trainer rank, after its shards are written: hashes its own files
    write_manifest(step_dir, run_id, step)     # last, after every file of the checkpoint is written
    problem = verify(step_dir)                 # None when intact; else why not, in a few words
    owner(step_dir)                            # the run id the manifest names (None: no readable manifest)
    complete_checkpoints(checkpoint_dir, run_id)  # the run's checkpoints with a manifest, oldest first
    path, skipped = newest_intact(checkpoint_dir, run_id)

The manifest is written into the checkpoint's temporary directory after everything else, before the rename
that makes the checkpoint complete (`commit`): a checkpoint without one was never finished, or was damaged
after. The files are hashed where they are written: each trainer rank hashes its own shards in a thread right
after writing them (`write_rank_digests`, a `.sha256-rank-N.json` beside them, while the bytes are still in the
page cache), so the controller only merges those and hashes what it wrote itself (`app_state.pt`), off its
event loop. Verification reads every file again; files hash in parallel threads (hashlib releases the GIL on
large buffers), each streamed in 8 MiB chunks, so memory stays flat whatever the checkpoint's size.
"""

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
STANDALONE = "trainer"  # the owner named by a checkpoint that Trainer.save() wrote outside any run
CHUNK = 8 << 20
RANK_DIGESTS = re.compile(r"\.sha256-rank-\d+\.json")
DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")  # the file name DCP's FileSystemWriter gives rank N's shards


def write_rank_digests(step_dir: Path, rank: int) -> None:
    """What trainer rank `rank` wrote into `step_dir` (its DCP shards; rank 0 also the metadata and any other
    top-level file), hashed and recorded in `.sha256-rank-<rank>.json` for `write_manifest` to take up."""
    step_dir = Path(step_dir)
    mine = sorted(p.name for p in step_dir.iterdir() if p.is_file() and _written_by(p.name) == rank)
    record = {
        name: dict(bytes=(step_dir / name).stat().st_size, sha256=d) for name, d in zip(mine, _digests(step_dir, mine))
    }
    (step_dir / f".sha256-rank-{rank}.json").write_text(json.dumps(record))


def _written_by(name: str) -> int | None:
    if name == MANIFEST or RANK_DIGESTS.fullmatch(name):
        return None
    shard = DCP_SHARD.fullmatch(name)
    return int(shard.group(1)) if shard else 0


def write_manifest(step_dir: Path, run_id: str, step: int) -> None:
    """Record every file under `step_dir` (relative path -> bytes, sha256) with the run and step. A file a
    trainer rank hashed as it wrote it (its `.sha256-rank-N.json`, same size) is not read again; the rest are
    hashed here. The ranks' digest files are removed once the manifest is written."""
    step_dir = Path(step_dir)
    known, sidecars = {}, list(step_dir.rglob(".sha256-rank-*.json"))
    for sidecar in sidecars:
        base = sidecar.parent.relative_to(step_dir)
        for name, entry in json.loads(sidecar.read_text()).items():
            known[str(base / name)] = entry
    files = sorted(
        str(p.relative_to(step_dir))
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST and not RANK_DIGESTS.fullmatch(p.name)
    )
    sizes = {f: (step_dir / f).stat().st_size for f in files}
    todo = [f for f in files if known.get(f, {}).get("bytes") != sizes[f]]
    digests = {**{f: known[f]["sha256"] for f in files if f not in todo}, **dict(zip(todo, _digests(step_dir, todo)))}
    record = dict(run_id=run_id, step=step, files={f: dict(bytes=sizes[f], sha256=digests[f]) for f in files})
    with open(step_dir / MANIFEST, "w") as fh:
        json.dump(record, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    for sidecar in sidecars:
        sidecar.unlink()


def commit(partial: Path, final: Path, run_id: str, step: int) -> None:
    """Make `partial` (every file written) the complete checkpoint `final`: its manifest, then a rename. A
    `final` already there (the same step saved again) is replaced whole, unless another run wrote it."""
    partial, final = Path(partial), Path(final)
    if final.exists() and owner(final) not in (run_id, None):
        raise FileExistsError(
            f"{final} is run {owner(final)}'s checkpoint; run {run_id} does not replace it: give "
            "each run its own trainer.checkpoint_dir"
        )
    write_manifest(partial, run_id, step)
    if final.exists():
        replaced = final.parent / f".{final.name}.{run_id}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
        partial.rename(final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        partial.rename(final)
    _VERIFIED[str(final.resolve())] = (_stamp(final), True)  # its files hashed as they were written


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


def verify(step_dir: Path, contents: bool = True) -> str | None:
    """None when every file the manifest lists is there with its size and checksum; otherwise the first
    problem found ('no manifest.json', 'missing __0_0.distcp', 'checksum mismatch in app_state.pt', ...).
    `contents=False` checks the sizes only (no file read)."""
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
    if not contents:
        return None
    names = list(files)
    for name, digest in zip(names, _digests(step_dir, names)):
        if digest != files[name].get("sha256"):
            _VERIFIED[str(step_dir.resolve())] = (_stamp(step_dir), False)
            return f"checksum mismatch in {name}"
    _VERIFIED[str(step_dir.resolve())] = (_stamp(step_dir), True)
    return None


# Checkpoints whose files this process hashed (or hashed as they were written): resolved path -> (their
# manifest's (inode, mtime), whether they matched). Retention asks `intact` at every save; reading a 32B
# checkpoint again each time would cost minutes, so one read per process suffices, sizes checked each time.
_VERIFIED: dict[str, tuple[tuple[int, int] | None, bool]] = {}


def _stamp(step_dir: Path) -> tuple[int, int] | None:
    try:
        st = (Path(step_dir) / MANIFEST).stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def intact(step_dir: Path, read: bool = True) -> bool:
    """Whether `step_dir` matches its manifest: its files read and hashed once in this process (by `verify`, or
    as they were written: `commit`), their sizes checked again on every call. `read=False` reads no file
    content: a checkpoint not hashed yet in this process passes on its sizes alone."""
    stamp = _stamp(step_dir)
    known = _VERIFIED.get(str(Path(step_dir).resolve()))
    if stamp is not None and known is not None and known[0] == stamp:
        return known[1] and verify(step_dir, contents=False) is None
    return verify(step_dir, contents=read) is None


def step_of(path: Path) -> int:
    return int(Path(path).name.split("-")[1])


def step_dirs(checkpoint_dir: Path) -> list[Path]:
    """Every step-N directory under `checkpoint_dir`, whoever wrote it and whatever its state, oldest first."""
    return sorted((p for p in Path(checkpoint_dir).glob("step-*") if p.is_dir() and p.name[5:].isdigit()), key=step_of)


def complete_checkpoints(checkpoint_dir: Path, run_id: str | None = None) -> list[Path]:
    """The complete checkpoints under `checkpoint_dir` (a manifest written), of run `run_id` only when given,
    oldest first. Completeness is not integrity: `verify` reads the files."""
    return [p for p in step_dirs(checkpoint_dir) if (o := owner(p)) is not None and run_id in (None, o)]


def newest_intact(checkpoint_dir: Path, run_id: str) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of run `run_id` whose files match their manifest, and why each newer candidate was
    passed over ('step-12: checksum mismatch in __0_0.distcp'). Candidates are the run's step directories and
    those without a readable manifest (whose owner cannot be told; a damaged one of this run's among them)."""
    skipped = []
    for path in reversed(step_dirs(checkpoint_dir)):
        if owner(path) not in (run_id, None):
            continue  # another run's
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name}: {problem}")
    return None, skipped


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
