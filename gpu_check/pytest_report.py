"""A pytest run as rows of `make gpu-check`'s table: its verdict, and for each test that failed, its name, the line
that failed and what it said; pytest's whole output kept in a file beside the table.

    rows = pytest_rows("no-vLLM tier", ["-m", "gpu", "tests/gpu/test_gpu.py"], out_dir, "no_vllm_tier", env)

The failures come from pytest's JUnit XML report (--junitxml), not from its console, whose layout changes between
pytest versions and options.
"""

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHERE = re.compile(r"^(\S+\.py):(\d+): ", re.MULTILINE)  # pytest's "tests/gpu/test_gpu.py:155: AssertionError"
MESSAGE_CHARS = 300


@dataclass(frozen=True)
class Failure:
    test: str  # e.g. test_critic_steps_on_the_gpu_and_gives_its_cached_memory_back
    where: str  # file:line of the line that failed, in the test's own file where pytest shows it
    line: str  # that line of source, as pytest shows it after ">"
    message: str  # the first line of the error: "assert (7373586432 - 7225487360) <= (64 * 1048576)"
    kind: str  # "failed" (an assertion or exception in the test) or "error" (in a fixture, or collecting)


def failures(junit_xml: Path) -> list[Failure]:
    """Every failed or erroring test in a pytest JUnit XML report, in run order."""
    found = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        for kind, tag in (("failed", "failure"), ("error", "error")):
            for node in case.findall(tag):
                text = node.text or ""
                places = WHERE.findall(text)
                own = [p for p in places if case.get("file") and p[0].endswith(case.get("file"))]
                file, line = (own or places or [("?", "?")])[-1]
                where = f"{outside_the_repo(file)}:{line}"
                lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith(">")]
                message = (node.get("message") or "").strip().splitlines() or ["(no message)"]
                found.append(
                    Failure(case.get("name", "?"), where, lines[-1] if lines else "", message[0][:MESSAGE_CHARS], kind)
                )
    return found


def outside_the_repo(file: str) -> str:
    """A file pytest names relative to the repository (its run's directory) as it is; one outside it absolute.
    pytest writes whichever of the relative and the absolute path is shorter, so a test file in a temporary folder
    beside a repository that is in one too would read "../pytest-of-root/..." otherwise."""
    return os.path.normpath(REPO / file) if file.startswith("..") else file


def rows_of(failed: list[Failure]) -> list[tuple[str, str]]:
    """One table row per failure: the test, then where, the failing line and what it said."""
    return [
        (f"  {f.kind}: {f.test}", f"{f.where}: `{f.line}`: {f.message}" if f.line else f"{f.where}: {f.message}")
        for f in failed
    ]


def summary_of(stdout: str) -> str:
    """pytest's closing line ('2 failed, 2 passed in 45.1s'), without its '=' rule."""
    tail = [ln for ln in stdout.splitlines() if re.search(r"\d+ (passed|failed|error|skipped|deselected)", ln)]
    return tail[-1].strip(" =") if tail else (stdout.strip().splitlines() or ["no output"])[-1][-300:]


def pytest_rows(
    what: str, args: list[str], out: Path, name: str, env: dict[str, str] | None = None
) -> list[tuple[str, str]]:
    """Run pytest on `args`; its output goes to OUT/<name>.log, its JUnit report to OUT/<name>.xml."""
    log, report = out / f"{name}.log", out / f"{name}.xml"
    report.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    took = time.perf_counter() - start
    log.write_text(f"$ pytest {' '.join(args)}\n(exit {proc.returncode}, {took:.0f} s)\n\n{proc.stdout}\n{proc.stderr}")
    verdict = "ok" if proc.returncode == 0 else "FAILED"
    rows = [(what, f"{verdict}: {summary_of(proc.stdout)} ({took:.0f} s); pytest's output: {log.name}")]
    if proc.returncode != 0 and report.exists():
        rows += rows_of(failures(report))
    return rows
