"""The layout rules of CONTRIBUTING.md and docs/design.md, checked: dependencies point one way (docs/design.md,
"Dependencies") and no module imports itself through others, nothing imports `apps`, the apps only read the
command line, no function in forge_rl/ or apps/ runs over ~60 lines, and no forge_rl module over 500 (past that a
file usually holds two ideas)."""

import ast
from pathlib import Path

from tests.conftest import REPO

MAX_FUNCTION_LINES = 60
MAX_APP_LINES = 60
MAX_MODULE_LINES = 500

# docs/design.md, "Dependencies": top to bottom; a package imports its own layer and the layers below it, and
# the bottom layer imports nothing of forge_rl.
LAYERS = (
    {"apps"},
    {"forge_rl.recipes", "forge_rl.rehearsal", "forge_rl.tinker"},
    {"forge_rl.loop", "forge_rl.agents"},
    {"forge_rl.actors", "forge_rl.envs", "forge_rl.runtime", "forge_rl.launch"},
    {
        "forge_rl.weights",
        "forge_rl.losses",
        "forge_rl.rewards",
        "forge_rl.data",
        "forge_rl.models",
        "forge_rl.observability",
    },
    {"forge_rl.types", "forge_rl.config", "forge_rl.deps"},
    {"forge_rl.errors"},
)
# The imports that go up a layer, each named in docs/design.md with its reason: (file, the module it imports).
UPWARD = {
    ("forge_rl/actors/replay_buffer.py", "forge_rl.loop.sampling"),  # the behaviour policy's one definition
    ("forge_rl/actors/generator.py", "forge_rl.loop.sampling"),  # which options truncate: kept sets recorded
    ("forge_rl/launch/launcher.py", "forge_rl.recipes"),  # the `submit` command line names a recipe
    ("forge_rl/rewards/workers.py", "forge_rl.launch.signals"),  # a reward worker dies with its parent
}


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


def _package(module: str) -> str | None:
    """The package a module belongs to for the layer rules: `apps`, `forge_rl.<name>`, or None (not ours)."""
    parts = module.split(".")
    if parts[0] == "apps":
        return "apps"
    return ".".join(parts[:2]) if parts[0] == "forge_rl" and len(parts) > 1 else None


def _project_imports(path: Path) -> set[str]:
    """Every forge_rl or apps module `path` imports, at the top or inside a function; `from a import b` counts as
    `a.b` (b may be a module) and relative imports are resolved against the file's package."""
    here = list(path.relative_to(REPO).with_suffix("").parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = here[:-1] if here[-1] != "__init__" else here
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if _package(n)}


def _layer(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def test_dependencies_point_one_way():
    """Every package is in a layer; none imports a layer above its own except for the imports in UPWARD."""
    upward, unplaced = [], set()
    for path in _python_files("forge_rl", "apps"):
        rel = str(path.relative_to(REPO))
        source = _package(".".join(path.relative_to(REPO).with_suffix("").parts))
        for name in sorted(_project_imports(path)):
            target = _package(name)
            if any(p not in set().union(*LAYERS) for p in (source, target)):
                unplaced.update(p for p in (source, target) if p not in set().union(*LAYERS))
                continue
            allowed = (
                target == source
                or _layer(target) > _layer(source)
                or (_layer(target) == _layer(source) and _layer(source) != len(LAYERS) - 1)
            )
            if not allowed and not any(rel == f and (name == m or name.startswith(m + ".")) for f, m in UPWARD):
                upward.append(f"{rel} imports {name}")
    assert not unplaced, f"packages in no layer of LAYERS (place them, and say where in docs/design.md): {unplaced}"
    assert upward == [], "imports against the layers of docs/design.md:\n" + "\n".join(upward)


def _module_graph() -> dict[str, set[str]]:
    """Every module of forge_rl/ and apps/ (a package's __init__.py as the package) -> the modules it imports,
    function-local imports included; `from a import b` is module `a.b` where that is a module, else `a`."""
    files = {}
    for path in _python_files("forge_rl", "apps"):
        parts = path.relative_to(REPO).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in files.items():
        graph[module] = set()
        for name in _project_imports(path):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return node, iter(sorted(graph[node]))

    for root in sorted(graph):
        if root in index:
            continue
        work = [visit(root)]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    work.append(visit(child))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while node not in component:
                    component.add(stack.pop())
                on_stack -= component
                if len(component) > 1:
                    components.append(component)
    return components


def _shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, as the list of modules it passes (first again last)."""
    start = min(component)
    paths, queue = {start: [start]}, [start]
    for node in queue:
        for child in sorted(graph[node] & component):
            if child == start:
                return paths[node] + [start]
            if child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_no_import_cycles():
    """No module imports itself through others, counting function-local imports (docs/design.md, "Dependencies"):
    what two modules both need moves down into a module below them. A package's __init__.py counts as the
    package, so a module that the package's __init__ imports must not import the package itself."""
    graph = _module_graph()
    cycles = []
    for component in _cycles(graph):
        cycle = _shortest_cycle(graph, component)
        others = sorted(component - set(cycle))
        cycles.append(" -> ".join(cycle) + (f"  (tied in with {', '.join(others)})" if others else ""))
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_every_upward_import_still_exists():
    """An exception that no longer happens is removed from UPWARD (and from docs/design.md)."""
    stale = [(f, m) for f, m in UPWARD if not any(n == m or n.startswith(m + ".") for n in _project_imports(REPO / f))]
    assert stale == []


def test_nothing_imports_apps():
    """The library, tests, benchmarks, the GPU check and notebooks use the runs in forge_rl/recipes, never an app."""
    offenders = [
        str(p.relative_to(REPO))
        for p in _python_files("forge_rl", "tests", "benchmarks", "gpu_check", "apps")
        if any(name == "apps" or name.startswith("apps.") for name in _imports(p))
    ]
    notebooks = [
        str(p.relative_to(REPO))
        for p in (REPO / "docs/notebooks").glob("*.ipynb")
        if "from apps" in p.read_text() or "import apps" in p.read_text()
    ]
    assert offenders + notebooks == []


def test_benchmarks_and_apps_leave_the_import_path_alone():
    """Benchmarks, the GPU check and the apps are packages run with `python -m` from the repository: none edits
    sys.path to find forge_rl (a child process in another environment gets PYTHONPATH instead)."""

    def edits_path(node: ast.AST) -> bool:
        target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        return isinstance(target, ast.Attribute) and target.attr == "path" and ast.unparse(target) == "sys.path"

    offenders = [
        str(p.relative_to(REPO))
        for p in _python_files("benchmarks", "gpu_check", "apps")
        if any(edits_path(node) for node in ast.walk(ast.parse(p.read_text())))
    ]
    assert offenders == []


def test_apps_are_thin():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _python_files("apps")}
    assert {p: n for p, n in sizes.items() if n > MAX_APP_LINES} == {}


def test_no_module_holds_two_ideas_by_its_length():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _python_files("forge_rl")}
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from a function's first statement after its docstring to its end: what a reader holds. The signature
    and the docstring are left out: the formatter puts a long signature one parameter a line."""
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def test_no_function_is_longer_than_a_reader_can_hold():
    long = []
    for path in _python_files("forge_rl", "apps"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _body_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], f"function bodies over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_folder_says_what_a_test_is():
    """tests/conftest.py marks everything under tests/integration/ `integration`; a test under tests/unit/ that
    marks itself so (it starts a process) belongs in tests/integration/, where `make test-fast` leaves it out."""
    marked = [
        str(p.relative_to(REPO))
        for p in (REPO / "tests/unit").rglob("*.py")
        if "@pytest.mark.integration" in p.read_text().replace('"@pytest.mark.integration"', "")
    ]
    assert marked == [], f"move these to tests/integration/: {marked}"
