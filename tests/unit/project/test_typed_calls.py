"""Endpoints are called through typed references in the run's code (recipes/, loop/, agents/, envs/):
`calls.call(buffer, ReplayBuffer.add, group)`, `rank.step.call_one(...)` on a typed rank, never an
endpoint's name as a string (`calls.call(buffer, "add")`, `getattr(mesh, "step")`), which no checker,
rename or reader follows from the call to the actor."""

import ast
from pathlib import Path

FORGE_RL = Path(__file__).resolve().parents[3] / "forge_rl"
CALLERS = ("recipes", "loop", "agents", "envs")
DECORATORS = {"endpoint", "concurrent_endpoint"}
CALLS = {"call", "call_one", "call_all", "route", "broadcast", "choose", "getattr"}


def endpoint_names() -> set[str]:
    """Every name a forge_rl actor declares as an endpoint (@endpoint, @concurrent_endpoint)."""
    names = set()
    for path in FORGE_RL.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    target = d.func if isinstance(d, ast.Call) else d
                    if getattr(target, "id", getattr(target, "attr", None)) in DECORATORS:
                        names.add(node.name)
    return names


def string_endpoint_calls(source: str, endpoints: set[str]) -> list[tuple[int, str]]:
    """(line, endpoint) of each call in `source` that names an endpoint as a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        callee = getattr(node.func, "attr", getattr(node.func, "id", None))
        if callee not in CALLS or (callee == "getattr" and len(node.args) != 2):  # with a default: an attribute
            continue
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in endpoints:
                found.append((node.lineno, arg.value))
    return sorted(found)


def test_the_runs_code_calls_no_endpoint_by_its_name_as_a_string():
    endpoints = endpoint_names()
    assert {"add", "next", "score", "step", "push_weights"} <= endpoints  # the scan finds the actors'
    offenders = [
        f"{path.relative_to(FORGE_RL.parent)}:{line}: endpoint {name!r} named as a string"
        for package in CALLERS
        for path in sorted((FORGE_RL / package).rglob("*.py"))
        for line, name in string_endpoint_calls(path.read_text(), endpoints)
    ]
    assert not offenders, "call through the actor class's endpoint instead:\n" + "\n".join(offenders)


def test_the_scan_finds_a_string_endpoint_in_each_form():
    endpoints = {"add", "step"}
    source = (
        "await calls.call(buffer, 'add', group)\n"
        "getattr(mesh, 'step')\n"
        "await calls.call(buffer, ReplayBuffer.add, group)\n"
        "console.print('add')\n"
        "getattr(error, 'add', None)\n"
    )
    assert string_endpoint_calls(source, endpoints) == [(1, "add"), (2, "step")]
