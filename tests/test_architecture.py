"""The house rules, checked on the source: imports form a DAG (lazy imports inside functions included), module by
module and folder by folder; the launcher's folders stand in one order, every import pointing down it; a
function-level import in the launcher is only of a heavy optional dependency, with its reason on the line; the library
never imports the launcher; and nothing outside the back-end registries branches on a back end's name."""
from __future__ import annotations

import ast
import os
import sys

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


# -- folders ----------------------------------------------------------------------------------------------------
# The launcher's folders (and top-level modules), bottom to top: each may import only those before it. Checkpoints
# sit above the back ends and the config: a checkpoint's identity is the config's training keys (store.py's hash),
# and whether it resumes on another world size is its back end's rule (resume.py); the back ends need nothing of
# checkpoints but their errors (the files a back end fully unpickles are checked by the Checkpointer, before it
# hands them over: LauncherBackend.unpickled_files).
LAUNCHER_LAYERS = ("launcher.errors", "launcher.import_path", "launcher.options", "launcher.launch",
                   "launcher.backends", "launcher.config", "launcher.checkpoint", "launcher.tasks", "launcher.train",
                   "launcher.report", "launcher.cli", "launcher.worker", "launcher", "launcher.__main__")


def _unit(module: str) -> str:
    """The folder (or top-level module) a module belongs to: ``launcher.train.trainer`` -> ``launcher.train``."""
    return ".".join(module.split(".")[:2])


def _folder_graph(package: str) -> dict[str, dict[str, str]]:
    """``{folder: {folder it imports: the first module doing it}}``, function-level imports included."""
    modules = _modules()
    graph: dict[str, dict[str, str]] = {}
    for name, path in sorted(modules.items()):
        if not name.startswith(package):
            continue
        graph.setdefault(_unit(name), {})
        for target in sorted(_imports(name, path, set(modules))):
            if target.startswith(package) and _unit(target) != _unit(name):
                graph[_unit(name)].setdefault(_unit(target), name)
    return graph


def _up_arrows(graph: dict[str, dict[str, str]], layers: tuple[str, ...]) -> list[str]:
    """Imports from a folder to one at its level or above it in ``layers``, and folders ``layers`` does not place."""
    rank = {name: i for i, name in enumerate(layers)}
    found = [f"{unit} is not in the layer order" for unit in graph if unit not in rank]
    for unit, targets in graph.items():
        for target, where in targets.items():
            if unit in rank and rank.get(target, len(layers)) >= rank[unit]:
                found.append(f"{where} imports {target}, which is not below {unit}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_folders_form_a_dag(package):
    graph = {unit: set(targets) for unit, targets in _folder_graph(package).items()}
    cycle = _cycle(graph)
    assert cycle is None, "folder import cycle: " + " -> ".join(cycle)


def test_launcher_imports_point_down_its_layers():
    found = _up_arrows(_folder_graph("launcher"), LAUNCHER_LAYERS)
    assert not found, "\n".join(found)


def test_the_layer_check_finds_an_up_arrow_and_an_unplaced_folder():
    graph = {"p.low": {}, "p.high": {"p.low": "p.high.x"}, "p.new": {}}
    assert _up_arrows(graph, ("p.low", "p.high")) == ["p.new is not in the layer order"]
    graph["p.low"] = {"p.high": "p.low.y"}
    assert _up_arrows(graph, ("p.low", "p.high", "p.new")) == ["p.low.y imports p.high, which is not below p.low"]


# -- function-level imports -------------------------------------------------------------------------------------
# What the launcher may import inside a function: a heavy optional dependency, kept off the paths that do not need
# it (torch on the login-node paths: check, slurm, config loading; the rest off every path that does not use them).
HEAVY = {"torch", "deepspeed", "transformers", "tokenizers", "datasets", "lightning", "wandb", "mlflow", "torchdata",
         "matplotlib"}


def _module_level_heavy(path: str, _seen: set | None = None) -> bool:
    """Whether the module at ``path`` imports a HEAVY package at module level, itself or through a project module it
    imports at module level (so importing it lazily is lazy torch)."""
    seen = set() if _seen is None else _seen
    seen.add(path)
    modules = _modules()
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] \
            if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name.split(".")[0] in HEAVY for name in names):
            return True
        for name in names:
            if name in modules and modules[name] not in seen and _module_level_heavy(modules[name], seen):
                return True
    return False


def _commented(lines: list[str], first: int, last: int) -> bool:
    """A comment on the statement (lines ``first``..``last``, 1-based) or in the run of imports and comments right
    above it (one reason may head a group of imports)."""
    if any("#" in line for line in lines[first - 1: last]):
        return True
    i = first - 2
    while i >= 0 and lines[i].strip().startswith(("import ", "from ", "#")):
        if "#" in lines[i]:
            return True
        i -= 1
    return False


def _function_level_imports(path: str):
    """``(line, names imported, has a comment)`` of every import statement inside a function of ``path``."""
    source = open(path, encoding="utf-8").read()
    lines = source.splitlines()
    found = []

    def walk(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    names = [f"{base}.{a.name}" if base else a.name for a in child.names]
                found.append((child.lineno, names, _commented(lines, child.lineno, child.end_lineno)))
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(source), False)
    return found


def _lazy_import_problems(package: str) -> list[str]:
    modules = _modules()
    problems = []
    for name, path in sorted(modules.items()):
        if not name.startswith(package):
            continue
        rel = os.path.relpath(path, ROOT)
        for line, names, commented in _function_level_imports(path):
            for target in names:
                top = target.split(".")[0]
                ours = next((m for m in (target, target.rsplit(".", 1)[0]) if m in modules), None)
                heavy = top in HEAVY or (ours is not None and _module_level_heavy(modules[ours]))
                if top in sys.stdlib_module_names or not heavy:
                    problems.append(f"{rel}:{line}: {target} is imported inside a function but is no heavy "
                                    f"optional dependency: import it at the top")
                    break
            else:
                if not commented:
                    problems.append(f"{rel}:{line}: a function-level import without its reason (a comment)")
    return problems


def test_launcher_imports_inside_functions_only_heavy_optional_dependencies():
    problems = _lazy_import_problems("launcher")
    assert not problems, "\n".join(problems)


def test_the_lazy_import_check_finds_a_light_import_and_a_missing_reason(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("import json\n\n\ndef f():\n    import os\n    import torch\n\n\ndef g():\n"
                    "    import torch  # the worker's\n    from torch import nn\n    x = 1\n    import wandb\n")
    found = _function_level_imports(str(path))
    assert [(line, names) for line, names, _ in found] == [(5, ["os"]), (6, ["torch"]), (10, ["torch"]),
                                                           (11, ["torch.nn"]), (13, ["wandb"])]
    assert [commented for *_, commented in found] == [False, False, True, True, False]
    assert _module_level_heavy(str(path)) is False
    path.write_text("from torch import nn\n")
    assert _module_level_heavy(str(path)) is True


def test_the_engine_stays_a_composition_of_parts():
    """The engine composes its parts (epoch_feed, open_window, optimizer_rules, noise_tracking, stop_poll,
    engine_options, ...): a feature that grows it past 450 lines belongs in a part of its own."""
    with open(os.path.join(ROOT, "accum_sched", "engine.py")) as f:
        lines = len(f.read().splitlines())
    assert lines <= 450, f"accum_sched/engine.py has {lines} lines: move the new feature into a part of its own"
