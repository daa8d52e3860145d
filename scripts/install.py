"""Install packages into the virtual environment whose Python runs this: `VENV/bin/python scripts/install.py ARGS...`,
ARGS as `pip install` takes them (requirements, `-e .[extra]`, `--index-url URL`).

With uv when it can be had (fetched into the venv on first use): it resolves to the same versions as pip and installs
them several times faster, which is most of a fresh setup's time. uv reads none of pip's configuration, so the sources
and constraints pip is configured with (pip.conf, PIP_* variables: index URLs, find-links, constraint files, the CA
bundle) are handed to it, and it looks at every index for the best version as pip does. Where uv cannot be fetched, or
fails, pip installs instead. Standard library only: it runs before anything else is installed."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

# pip's configuration keys that say where packages come from and which versions are allowed, as uv's flags
SOURCES = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
CONSTRAINTS = {"constraint": "--constraint"}


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True
    )


def pip_configuration() -> dict[str, list[str]]:
    """pip's effective settings (files and PIP_* variables, as `pip config list` shows them), key -> values. A PIP_*
    variable (scope ":env:") wins over the files, as it does for pip."""
    settings: dict[str, list[str]] = {}
    for line in pip("config", "list").stdout.splitlines():
        scoped_key, _, value = line.partition("=")
        scope, _, key = scoped_key.rpartition(".")
        if scope == ":env:" or key not in settings:
            settings[key] = value.strip("'\"").split()
    return settings


def uv_binary() -> str | None:
    """uv's executable, installed into this venv with pip if it is not there yet; None where that fails."""
    here = Path(sys.executable).parent / "uv"
    if here.exists() or pip("install", "-q", "uv").returncode == 0 and here.exists():
        return str(here)
    return shutil.which("uv")


def uv_command(uv: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    settings = pip_configuration()
    cmd = [uv, "pip", "install", "--quiet", "--python", sys.executable, "--index-strategy", "unsafe-best-match"]
    # .pyc files written now, as pip writes them: else every process started with PYTHONDONTWRITEBYTECODE (as CI's
    # are) compiles each module it imports, torch's and vLLM's included, at every start
    cmd.append("--compile-bytecode")
    for key, flag in {**SOURCES, **CONSTRAINTS}.items():
        if key == "index-url" and "--index-url" in args:
            continue  # the caller's own index replaces pip's default one
        for value in settings.get(key, []):
            cmd += [flag, value]
    env = dict(os.environ)
    if cert := settings.get("cert"):
        env["SSL_CERT_FILE"] = cert[0]
    return cmd + args, env


def main(args: list[str]) -> int:
    if uv := uv_binary():
        cmd, env = uv_command(uv, args)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return 0
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"forge_rl: uv could not install {' '.join(args)} ({why}); installing with pip", file=sys.stderr)
    done = pip("install", "-q", *args)
    sys.stderr.write(
        "".join(line + "\n" for line in done.stderr.splitlines() if not line.startswith("WARNING: Location"))
    )
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
