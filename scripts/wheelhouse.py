"""`make wheelhouse`: every wheel forge_rl's no-vLLM tier needs, for another machine's Python, in 60 MB parts.

    python3 scripts/wheelhouse.py --python 3.12 [--out wheelhouse/cp312] [--glibc 2.28] [--with-vllm]

For a GPU host with a site PyTorch and no network. Run it on a machine that reaches PyPI (any Python with pip
and `packaging`): pip resolves forge_rl's dependencies for the target (CPython X.Y, manylinux x86_64 up to
the given glibc) as if installing, with torch==2.13.0 (the pin) so that the rest agrees with it, from package
metadata alone; then the wheels are downloaded, except torch and what only torch needs (nvidia-*, triton,
cuda-*: the site's torch brings its own) and, unless --with-vllm, vLLM (which pins torch 2.13.0, and which a
host with another torch cannot run anyway). pytest, pytest-timeout and setuptools come along: `make gpu-check`
runs pytest, and forge_rl installs from its checkout. The wheels go into one tar cut into parts of at most
60 MB, beside MANIFEST.json (each part's size and sha256, the wheel list, what was left out).
scripts/install_wheelhouse.py installs them on the host.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheelhouse_parts import PART_BYTES, pack  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXTRA_ROOTS = ["pytest>=8", "pytest-timeout>=2.3", "setuptools>=68", "wheel"]
LEFT_OUT = {"torch"}  # with all that only it needs


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def target_flags(python: str, glibc: str) -> list[str]:
    """pip's flags for CPython `python` on manylinux x86_64 with glibc <= `glibc` (pip matches tags exactly)."""
    major, minor = (int(x) for x in glibc.split("."))
    tag = f"cp{python.replace('.', '')}"
    platforms = [f"manylinux_{major}_{m}_x86_64" for m in range(5, minor + 1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return [
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        tag,
        "--abi",
        "abi3",
        "--abi",
        "none",
        *(f for p in platforms for f in ("--platform", p)),
    ]


def project_requirements(with_vllm: bool) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + (project["optional-dependencies"]["gpu"] if with_vllm else []) + EXTRA_ROOTS


def resolve(requirements: list[str], flags: list[str], scratch: Path) -> list[dict]:
    """pip's resolution for the target, from metadata (no wheel is downloaded): the report's install items."""
    report = scratch / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--quiet",
        "--ignore-installed",
        "--report",
        str(report),
        "--target",
        str(scratch / "target"),
        *flags,
        *requirements,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        errors = [line for line in out.stderr.splitlines() if line.startswith("ERROR")]
        sys.exit(
            f"wheelhouse: pip could not resolve forge_rl's dependencies for this target: "
            f"{' / '.join(errors) or out.stderr[-500:]}"
        )
    return json.loads(report.read_text())["install"]


def needed(items: list[dict], python: str, left_out: set[str]) -> set[str]:
    """Names reachable from the requested roots without passing through `left_out` (markers evaluated for the
    target: Linux x86_64, this Python, the extras each package was asked for)."""
    env = dict(
        python_version=python,
        python_full_version=f"{python}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    by_name = {canonical(i["metadata"]["name"]): i for i in items}
    extras: dict[str, set[str]] = {}  # each reached package with the extras asked of it (datasets: fsspec[http])
    todo = [
        (n, set(i.get("requested_extras") or []))
        for n, i in by_name.items()
        if i.get("requested") and n not in left_out
    ]
    while todo:
        name, asked = todo.pop()
        if name in extras and asked <= extras[name]:
            continue
        extras[name] = extras.get(name, set()) | asked
        for line in by_name[name]["metadata"].get("requires_dist", []):
            req = Requirement(line)
            dep = canonical(req.name)
            if dep in left_out or dep not in by_name:
                continue
            if req.marker is None or any(
                Marker(str(req.marker)).evaluate(dict(env, extra=e)) for e in {"", *extras[name]}
            ):
                todo.append((dep, set(req.extras)))
    return set(extras)


def download(pins: list[str], flags: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest), *flags, *pins]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"wheelhouse: pip download failed: {out.stderr.strip().splitlines()[-1]}")


def wheel_records(wheels: Path, items: dict[str, dict]) -> list[dict]:
    from wheelhouse_parts import sha256_of

    records = []
    for path in sorted(wheels.glob("*.whl")):
        name = canonical(path.name.split("-")[0])
        records.append(
            dict(
                file=path.name,
                name=name,
                version=items[name]["metadata"]["version"],
                bytes=path.stat().st_size,
                sha256=sha256_of(path),
            )
        )
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", required=True, help="the host's Python as X.Y, e.g. 3.12")
    ap.add_argument("--out", type=Path, default=None, help="default: wheelhouse/cpXY")
    ap.add_argument("--glibc", default="2.28", help="the host's glibc at least (`ldd --version`); default 2.28")
    ap.add_argument(
        "--with-vllm",
        action="store_true",
        help="vLLM too (its tier needs torch 2.13.0 on the host; its llguidance needs --glibc 2.35)",
    )
    ap.add_argument("--part-mb", type=float, default=PART_BYTES / 1e6, help="largest part in MB (1e6 bytes)")
    args = ap.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python):
        sys.exit(f"wheelhouse: --python {args.python!r} is not X.Y (e.g. 3.12)")
    tag = f"cp{args.python.replace('.', '')}"
    out = args.out or REPO / "wheelhouse" / tag
    flags = target_flags(args.python, args.glibc)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as scratch:
        items = resolve(project_requirements(args.with_vllm), flags, Path(scratch))
        by_name = {canonical(i["metadata"]["name"]): i for i in items}
        keep = needed(items, args.python, LEFT_OUT)
        left_out = sorted(set(by_name) - keep)
        wheels = Path(scratch) / "house" / "wheels"
        download([f"{n}=={by_name[n]['metadata']['version']}" for n in sorted(keep)], flags, wheels)
        records = wheel_records(wheels, by_name)
        manifest = dict(
            python=args.python,
            abi=tag,
            platform=f"manylinux (glibc >= {args.glibc}) x86_64",
            made=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            wheels=records,
            left_out=dict(
                torch_and_what_only_torch_needs=[f"{n}=={by_name[n]['metadata']['version']}" for n in left_out],
                vllm=(
                    "included (needs torch 2.13.0 on the host)"
                    if args.with_vllm
                    else "left out, and what only it needs: its tier needs torch 2.13.0 on the host"
                ),
            ),
            torch_pin=by_name["torch"]["metadata"]["version"],
        )
        (wheels.parent / "wheelhouse.json").write_text(json.dumps(manifest, indent=1) + "\n")
        for old in out.glob(f"forge_rl-wheelhouse-{tag}.tar*") if out.exists() else []:
            old.unlink()
        record = pack(wheels.parent, out, f"forge_rl-wheelhouse-{tag}.tar", manifest, int(args.part_mb * 1e6))
    total = sum(r["bytes"] for r in records)
    print(
        f"wheelhouse: {len(records)} wheels for CPython {args.python}, {total / 1e6:.0f} MB, in "
        f"{len(record['parts'])} parts of at most {args.part_mb:.0f} MB in {out} ({time.perf_counter() - start:.0f} s)"
    )
    print(
        f"  left out: torch (the host's own) and {len(left_out) - 1} packages only it needs; "
        + ("vLLM included" if args.with_vllm else "vLLM and what only it needs (its tier needs torch 2.13.0)")
    )
    print(f"  on the host: python{args.python} scripts/install_wheelhouse.py {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
