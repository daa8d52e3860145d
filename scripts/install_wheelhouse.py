"""Install forge_rl from a wheelhouse on a host with no network, next to the site's PyTorch.

    python3.12 scripts/install_wheelhouse.py WHEELHOUSE_DIR [--venv .venv | --into-current]

Run it from the forge_rl checkout with the Python whose torch the site provides (the Python the wheelhouse was
made for: `make wheelhouse PYTHON_VERSION=X.Y`). It checks every part against MANIFEST.json, joins and unpacks
them, creates the venv with --system-site-packages (the site's torch stays visible and is used; nothing
replaces it), installs every wheel with --no-index --no-deps (the wheel list is complete: nothing is resolved,
so forge_rl's torch==2.13.0 pin cannot pull a torch), then forge_rl from this checkout (editable, --no-deps),
and says what it did. `make gpu-check VENV=<the venv>` then runs what this host can run.
Standard library only.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheelhouse_parts import PartsError, read_manifest, reassemble  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETUP_STAMP = ".forge_rl-setup-done"  # the Makefile's: `make gpu-check VENV=...` then skips setup_env.sh
IMPORTS = "import torch, monarch.actor, torchtitan, forge_rl; print(torch.__version__, torch.cuda.is_available())"


def run(cmd: list, what: str) -> str:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr.strip() or out.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"install_wheelhouse: {what} failed: {tail[0]}")
    return out.stdout


def site_torch(python: str) -> str:
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(
            f"install_wheelhouse: {python} cannot import torch: the wheelhouse leaves torch out (the "
            "site's build is used); load the site's PyTorch (module load, conda activate) and run again"
        )
    return out.stdout.strip()


def target_python(args) -> tuple[Path, bool]:
    """The environment's python, and whether a venv was created for it."""
    if args.into_current:
        return Path(sys.executable), False
    venv = args.venv.resolve()
    if (venv / "bin" / "python").exists():
        return venv / "bin" / "python", False
    run([sys.executable, "-m", "venv", "--system-site-packages", venv], f"creating the venv {venv}")
    return venv / "bin" / "python", True


def pip_check(python: Path) -> tuple[list[str], list[str]]:
    """pip check's complaints, split into those about torch (expected: the site's torch is not the pin) and the rest."""
    out = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True).stdout.splitlines()
    lines = [line for line in out if line.strip() and not line.startswith("No broken")]
    about_torch = [line for line in lines if "torch" in line.split(" requires ")[-1].split(",")[0]]
    return about_torch, [line for line in lines if line not in about_torch]


def install(python: Path, wheels: Path) -> None:
    pip = [
        python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--quiet",
        "--no-index",
        "--no-deps",
        "--find-links",
        wheels,
    ]
    run([*pip, *sorted(wheels.glob("*.whl"))], "installing the wheels")
    run([*pip, "--no-build-isolation", "-e", REPO], f"installing forge_rl from {REPO}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheelhouse", type=Path, help="the folder with MANIFEST.json and the parts")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--venv", type=Path, default=REPO / ".venv", help="default: the checkout's .venv")
    where.add_argument("--into-current", action="store_true", help="into this Python's environment instead")
    args = ap.parse_args()
    start = time.perf_counter()
    try:
        manifest = read_manifest(args.wheelhouse)
    except PartsError as e:
        raise SystemExit(f"install_wheelhouse: {e}") from None
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here != manifest["python"]:
        raise SystemExit(
            f"install_wheelhouse: the wheelhouse is for Python {manifest['python']} ({manifest['abi']}), "
            f"this is Python {here}: run it with python{manifest['python']}, or make one with "
            f"`make wheelhouse PYTHON_VERSION={here}`"
        )
    torch_version = site_torch(sys.executable)
    with tempfile.TemporaryDirectory(prefix="forge_rl-wheelhouse-") as scratch:
        try:
            reassemble(args.wheelhouse, Path(scratch))
        except PartsError as e:
            raise SystemExit(f"install_wheelhouse: {e}") from None
        checked = time.perf_counter() - start
        python, created = target_python(args)
        install(python, Path(scratch) / "wheels")
    if not args.into_current:
        (python.parent.parent / SETUP_STAMP).touch()
    versions = run([python, "-c", IMPORTS], "importing torch, monarch, torchtitan and forge_rl").split()
    about_torch, other = pip_check(python)
    vllm = (
        subprocess.run(
            [python, "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        == "True"
    )
    report(
        args,
        manifest,
        python,
        created,
        torch_version,
        versions,
        about_torch,
        other,
        vllm,
        checked,
        time.perf_counter() - start,
    )
    return 1 if other else 0


def report(args, manifest, python, created, torch_version, versions, about_torch, other, vllm, checked, total) -> None:
    parts = manifest["parts"]
    env = (
        "this Python's environment"
        if args.into_current
        else (f"{'new ' if created else 'existing '}venv {python.parent.parent} (system site packages visible)")
    )
    print(
        f"install_wheelhouse: {len(parts)} parts ({sum(p['bytes'] for p in parts) / 1e6:.0f} MB) checked and "
        f"joined in {checked:.0f} s; {len(manifest['wheels'])} wheels and forge_rl (editable, {REPO}) installed "
        f"into {env} in {total:.0f} s, offline"
    )
    print(
        f"  torch: the site's {torch_version} (CUDA available: {versions[1]}); forge_rl pins torch=="
        f"{manifest.get('torch_pin', '2.13.0')}, so pip check names torch {len(about_torch)} time(s): expected"
    )
    for line in other:
        print(f"  pip check: {line}")
    venv = python.parent.parent
    check = (
        "python -m gpu_check"
        if args.into_current
        else f"make gpu-check VENV={venv.relative_to(REPO) if venv.is_relative_to(REPO) else venv}"
    )
    print(
        f"  vLLM: {'installed' if vllm else 'not installed (the wheelhouse leaves it out)'}; `{check}` says which "
        "tiers run here and runs them"
    )


if __name__ == "__main__":
    raise SystemExit(main())
