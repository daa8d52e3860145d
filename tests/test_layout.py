"""The layout rules of CONTRIBUTING.md and docs/design.md, checked: nothing imports `apps`, the apps only read
the command line, and no function in forge_rl/ or apps/ runs over ~60 lines."""

import ast
from pathlib import Path

from tests.conftest import REPO

MAX_FUNCTION_LINES = 60
MAX_APP_LINES = 60


def _python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_nothing_imports_apps():
    """The library, tests, benchmarks and notebooks use the runs in forge_rl/recipes, never an app."""
    offenders = [str(p.relative_to(REPO)) for p in _python_files("forge_rl", "tests", "benchmarks", "apps")
                 if any(name == "apps" or name.startswith("apps.") for name in _imports(p))]
    notebooks = [str(p.relative_to(REPO)) for p in (REPO / "docs/notebooks").glob("*.ipynb")
                 if "from apps" in p.read_text() or "import apps" in p.read_text()]
    assert offenders + notebooks == []


def test_apps_are_thin():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _python_files("apps")}
    assert {p: n for p, n in sizes.items() if n > MAX_APP_LINES} == {}


def test_no_function_is_longer_than_a_reader_can_hold():
    long = []
    for path in _python_files("forge_rl", "apps"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
