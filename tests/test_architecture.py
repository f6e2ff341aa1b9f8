"""The house rules, checked on the source: imports form a DAG (lazy imports inside functions included), the library
never imports the launcher, and nothing outside the back-end registries branches on a back end's name."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("accum_sched", "launcher")


def _modules() -> dict[str, str]:
    """module name -> file, for every module of the two packages."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, name)
    return out


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """Every project module ``module`` imports, at module level or inside a function."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = module.split(".")
                parts = parts if is_package else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` depends on the submodule, not on pkg's __init__
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name in known and name != module}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_imports_form_a_dag():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_library_never_imports_the_launcher():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("accum_sched"):
            bad = {m for m in _imports(name, path, set(modules)) if m.startswith("launcher")}
            assert not bad, f"{name} imports {bad}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


BACKEND_NAMES = {"ddp", "fsdp", "deepspeed"}


def _name_branches(path: str) -> list[int]:
    """Lines comparing something against a back end's name (``x == "fsdp"``, ``x in ("ddp", ...)``)."""
    lines = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                values = [operand] if isinstance(operand, ast.Constant) else \
                    list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else []
                if any(isinstance(v, ast.Constant) and v.value in BACKEND_NAMES for v in values):
                    lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("package,registry", [("accum_sched", "accum_sched/backends"),
                                              ("launcher", "launcher/backends")])
def test_no_backend_branches_outside_the_registry(package, registry):
    found = []
    for name, path in _modules().items():
        rel = os.path.relpath(path, ROOT)
        if name.startswith(package) and not rel.startswith(registry):
            found += [f"{rel}:{line}" for line in _name_branches(path)]
    assert not found, "back-end name branches outside the registry: " + ", ".join(found)
