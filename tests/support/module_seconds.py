"""How long each test module takes, so that `make test` can start the longest first.

`make test` runs whole modules on its workers (pytest-xdist, --dist loadfile). Started in pytest's order, a module of
a few minutes can come last and run alone while the other worker has nothing left. Started longest first, the short
ones fill the gaps at the end. The times are read from a `--durations=0` run's output and kept in
module_seconds.json beside this file. An integration module not in it (a new one) counts as long, so it starts early;
any other counts as short (pytest leaves out of its report the tests under 5 ms).

Refresh after adding or growing a slow module:
    make test ARGS=--durations=0 | tee /tmp/durations.log
    .venv/bin/python -m tests.support.module_seconds /tmp/durations.log
"""

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("module_seconds.json")
# a line of pytest's durations report: "12.34s call     tests/x/test_y.py::test_z[param]"
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown) +(\S+?\.py)::")


def read_log(text: str) -> dict[str, float]:
    """Seconds per module (setup, call and teardown of its tests summed) from a `--durations=0` report."""
    seconds: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if match := DURATION.match(line.strip()):
            seconds[match[2]] += float(match[1])
    return {module: round(s, 2) for module, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def known_seconds() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def longest_first(paths: list[str]) -> list[str]:
    """The module paths (relative to the repository) in the order to start them, longest first; ties keep the given
    order."""
    seconds = known_seconds()
    return sorted(paths, key=lambda p: -seconds.get(p, float("inf") if p.startswith("tests/integration/") else 0.0))


if __name__ == "__main__":
    measured = read_log(Path(sys.argv[1]).read_text())
    if not measured:
        raise SystemExit(f"{sys.argv[1]}: no durations in it (run pytest with --durations=0)")
    TABLE.write_text(json.dumps(measured, indent=1) + "\n")
    print(f"{TABLE}: {len(measured)} modules, {sum(measured.values()):.0f} s in all")
