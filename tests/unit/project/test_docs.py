"""What README.md and docs/ name exists: every `package.module:function`, every forge_rl module path and file,
and every dotted config key of a run's config. A rename that leaves a doc behind fails here."""

import ast
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import re
import typing
from pathlib import Path

import pytest

from tests.conftest import REPO

# docs/benchmarks_history.md is a record of past runs: it names files as they were when each ran
DOCS = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "benchmarks_history.md"),
]
CODE = re.compile(r"`([^`\n]+)`")


def _spans(path: Path) -> list[str]:
    """Inline code spans and the lines of fenced blocks."""
    text = path.read_text()
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    inline = CODE.findall(re.sub(r"```.*?```", "", text, flags=re.S))
    return inline + [line for b in blocks for line in b.splitlines()]


def _named(pattern: str) -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        for span in _spans(doc):
            for m in re.finditer(pattern, span):
                found.add((doc.name, m.group(0)))
    return sorted(found)


def _defined_in(tree: ast.AST, name: str) -> ast.AST | None:
    """The statement of `tree`'s body that binds `name` (a def, a class, an assignment, an import), or None."""
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return node
    return None


def _resolve(dotted: str) -> None:
    """A module, or an attribute of one (forge_rl.recipes.rl_run.RLRun.rl_step), found in the module's source
    without importing it: importing would cost the test an optional integration's import (OpenEnv pulls in gradio,
    seconds). A name the source binds in a way the syntax tree does not show is looked up by importing."""
    parts = dotted.split(".")
    spec = importlib.import_module(parts[0]).__spec__  # the top package itself is light; its submodules may not be
    found = 1  # how many of parts name modules: submodules are found on their package's path, importing nothing
    while found < len(parts) and spec.submodule_search_locations:
        child = importlib.machinery.PathFinder.find_spec(".".join(parts[: found + 1]), spec.submodule_search_locations)
        if child is None:
            break
        spec, found = child, found + 1
    if spec.origin is None:  # a namespace package: no source of its own to look in
        return _import_and_get(parts, found)
    node = ast.parse(Path(spec.origin).read_text())
    for attr in parts[found:]:
        node = _defined_in(node, attr)
        if node is None or (not isinstance(node, ast.ClassDef) and attr != parts[-1]):
            return _import_and_get(parts, found)  # bound dynamically, absent, or an attribute of an imported object
    return None


def _import_and_get(parts: list[str], module_parts: int) -> None:
    obj = importlib.import_module(".".join(parts[:module_parts]))
    for attr in parts[module_parts:]:
        obj = getattr(obj, attr)


@pytest.mark.parametrize("doc,name", _named(r"(?<![\w/])forge_rl(?:\.[A-Za-z_]\w*)+(?::\w+)?(?![\w/])"))
def test_module_paths_and_functions_exist(doc, name):
    """`forge_rl.recipes.grpo`, `forge_rl.runtime.provisioned()`, `forge_rl.data.arithmetic:training_rows`."""
    try:
        _resolve(name.replace(":", "."))
    except (ModuleNotFoundError, AttributeError) as e:
        pytest.fail(f"{doc} names {name}, which does not exist ({e})")


@pytest.mark.parametrize("doc,path", _named(r"\b(?:forge_rl|apps|configs|benchmarks|tests|docs|scripts)/[\w./-]*\w"))
def test_file_paths_exist(doc, path):
    path = path.split(":")[0]
    if any(c in path for c in "*<>{}") or path.endswith((".log", ".out")):
        return
    assert (REPO / path).exists(), f"{doc} names {path}, which is not in the repository"


def _config_keys() -> list[tuple[str, str]]:
    """Dotted keys in inline code (`trainer.loss.kl_coef`, `generator.replicas=2`) and key=value overrides in
    command lines; not endpoint calls (`buffer.add`) in prose or diagrams."""
    key = r"[a-z_]+(?:\.[a-z_0-9]+)+"
    found = set()
    for doc in DOCS:
        text = doc.read_text()
        for span in CODE.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
            if m := re.fullmatch(rf"({key})(=.*)?", span.strip()):
                found.add((doc.name, m.group(1)))
        for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
            found.update((doc.name, k) for k in re.findall(rf"(?<![\w./'-])({key})=", block))
    return sorted(found)


def _config_roots():
    """Every run's config: distillation's and PPO's hold GRPO's keys and add their own (teacher; critic, ppo)."""
    from forge_rl.recipes.distill_config import DistillConfig
    from forge_rl.recipes.ppo_config import PPOConfig
    from forge_rl.recipes.sft_config import SFTConfig

    return [DistillConfig, PPOConfig, SFTConfig]


def _has_key(schema, keys: list[str]) -> bool:
    """Whether `a.b.c` is a field path of the dataclass `schema` (anything under a dict or Any field counts)."""
    hints = typing.get_type_hints(schema)
    head, rest = keys[0], keys[1:]
    if head not in {f.name for f in dataclasses.fields(schema)}:
        return False
    if not rest:
        return True
    hint = hints[head]
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return _has_key(candidate, rest)
    origin = typing.get_origin(hint) or hint
    return origin in (dict, typing.Any) or hint is typing.Any


def test_dotted_config_keys_exist():
    """`trainer.loss.kl_coef`, `generator.sampling.temperature=...`: every dotted key whose first part is a
    section of a run's config (trainer, generator, buffer, critic, ppo, ...) is a field path of GRPO's,
    distillation's, PPO's or SFT's config."""
    roots = _config_roots()
    sections = {
        f.name
        for schema in roots
        for f in dataclasses.fields(schema)
        if dataclasses.is_dataclass(f.type) or "Config" in str(f.type) or "Section" in str(f.type)
    }
    missing = []
    for doc, key in _config_keys():
        keys = key.split(".")
        if keys[0] not in sections or key.endswith((".py", ".yaml", ".json", ".md")):
            continue
        if not any(_has_key(schema, keys) for schema in roots):
            missing.append(f"{doc}: {key}")
    assert not missing, "config keys named in the docs that no run's config has:\n" + "\n".join(missing)
