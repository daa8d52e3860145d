"""A wheelhouse as one tar cut into parts of at most PART_BYTES, with a manifest of checksums; and back.

Standard library only: the installer runs it on a host that has nothing but Python and the site's PyTorch.

    MANIFEST.json   {"archive": {name, bytes, sha256}, "parts": [{name, bytes, sha256}, ...], ...}
    NAME.tar.000, NAME.tar.001, ...   the tar's bytes in order, each at most PART_BYTES
"""

import hashlib
import json
import tarfile
from pathlib import Path

PART_BYTES = 60 * 1000 * 1000  # 60 MB, and below 60 MiB too: whichever a transfer limit means
MANIFEST = "MANIFEST.json"
CHUNK = 4 * 2**20


class PartsError(Exception):
    """A part missing, of the wrong size or checksum, or a manifest that does not describe the parts."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def split_file(archive: Path, out_dir: Path, part_bytes: int = PART_BYTES) -> list[dict]:
    """Cut `archive` into out_dir/<archive name>.000, .001, ... of at most part_bytes each; their records."""
    parts, index = [], 0
    with open(archive, "rb") as src:
        while True:
            path = out_dir / f"{archive.name}.{index:03d}"
            digest, size = hashlib.sha256(), 0
            with open(path, "wb") as dst:
                while size < part_bytes and (block := src.read(min(CHUNK, part_bytes - size))):
                    dst.write(block)
                    digest.update(block)
                    size += len(block)
            if size == 0 and index > 0:  # the archive ended exactly at the last part's end
                path.unlink()
                break
            parts.append(dict(name=path.name, bytes=size, sha256=digest.hexdigest()))
            index += 1
            if size < part_bytes:
                break
    return parts


def pack(src_dir: Path, out_dir: Path, archive_name: str, manifest: dict, part_bytes: int = PART_BYTES) -> dict:
    """Tar src_dir's files (uncompressed: wheels are zip files already), cut the tar into parts in out_dir, and
    write out_dir/MANIFEST.json: `manifest` plus the archive's and each part's size and sha256."""
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / archive_name
    with tarfile.open(archive, "w") as tar:
        for path in sorted(src_dir.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(src_dir)))
    record = dict(
        manifest,
        archive=dict(name=archive_name, bytes=archive.stat().st_size, sha256=sha256_of(archive)),
        part_limit_bytes=part_bytes,
        parts=split_file(archive, out_dir, part_bytes),
    )
    archive.unlink()
    (out_dir / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
    return record


def read_manifest(parts_dir: Path) -> dict:
    path = parts_dir / MANIFEST
    if not path.is_file():
        raise PartsError(f"{path} is missing: copy the whole wheelhouse folder (its {MANIFEST} and every part)")
    try:
        manifest = json.loads(path.read_text())
        manifest["archive"]["sha256"], manifest["parts"][0]["name"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise PartsError(
            f"{path} is not a wheelhouse manifest (no archive or parts): make it again with `make wheelhouse`"
        ) from None
    return manifest


def verify_parts(parts_dir: Path, manifest: dict) -> None:
    """Every part present, of its size and sha256; raise PartsError naming the first one that is not."""
    for part in manifest["parts"]:
        path = parts_dir / part["name"]
        if not path.is_file():
            raise PartsError(f"part {part['name']} is missing from {parts_dir}: copy it over again")
        if path.stat().st_size != part["bytes"]:
            raise PartsError(
                f"part {part['name']} has {path.stat().st_size} bytes, the manifest says "
                f"{part['bytes']}: the copy was cut short; copy it over again"
            )
        if sha256_of(path) != part["sha256"]:
            raise PartsError(
                f"part {part['name']} does not match its sha256 in {MANIFEST}: it was damaged on the "
                "way; copy it over again"
            )


def reassemble(parts_dir: Path, dest_dir: Path) -> dict:
    """Check the parts, join them into the archive (checked as a whole too) and unpack it into dest_dir."""
    manifest = read_manifest(parts_dir)
    verify_parts(parts_dir, manifest)
    dest_dir.mkdir(parents=True, exist_ok=True)
    archive = dest_dir / manifest["archive"]["name"]
    digest = hashlib.sha256()
    with open(archive, "wb") as dst:
        for part in manifest["parts"]:
            with open(parts_dir / part["name"], "rb") as src:
                while block := src.read(CHUNK):
                    dst.write(block)
                    digest.update(block)
    if digest.hexdigest() != manifest["archive"]["sha256"]:
        raise PartsError(
            f"the joined parts do not match the archive's sha256 in {MANIFEST}: the parts are from "
            "different wheelhouses; copy one wheelhouse folder over whole"
        )
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest_dir, filter="data")
        else:  # Python < 3.11.4: no filters; names are checked instead
            if bad := [m.name for m in tar.getmembers() if m.name.startswith("/") or ".." in Path(m.name).parts]:
                raise PartsError(f"the archive holds a path outside its folder ({bad[0]}): not a wheelhouse")
            tar.extractall(dest_dir)
    archive.unlink()
    return manifest
