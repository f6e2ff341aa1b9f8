"""Tasks: what to train. `task.target` is "module:function" (or "builtin:NAME"), called with `task.args`.

The function returns a mapping or object with ``model`` (nn.Module), ``dataset`` (map-style Dataset, or an
IterableDataset: a stream, launcher/train/streams.py), ``loss_fn(model, batch) -> (loss_sum, n_elements)`` and
optionally ``collate_fn``, ``length_fn(sample) -> n_elements`` and ``count_fn(batch) -> n_elements`` (the same
count without a forward pass; one of the two is needed only to plan LR totals of token-keyed schedules (a stream
needs only ``count_fn``, for token-keyed schedules themselves): every sample is counted once, by ``length_fn``,
else by ``count_fn`` of a one-sample batch, so it must add up over samples, as a count of real tokens does),
``val_dataset`` (held-out
samples, same form as ``dataset``; evaluated as the config's ``eval`` section says, see launcher/train/evaluate.py),
``val_loss_fn`` (default: ``loss_fn``), ``metrics_fn(model, batch) -> {name: (sum, count)}`` (each metric is
reported as sum / count over the whole set) and ``save_fn(state_dict, output_dir)`` (rank 0 writes the task's own
export of the final weights next to model.pt, e.g. a Hugging Face directory).

`check_target` verifies a target before launch without importing it (so without torch): the module must be
findable and define the function at top level.
"""
from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.errors import ConfigError
from launcher.import_path import ensure_cwd_on_path

BUILTINS = {
    "regression": "launcher.tasks.builtin:regression",
    "charlm": "launcher.tasks.builtin:charlm",
    "hf_causal_lm": "launcher.tasks.hf:hf_causal_lm",
    "stream_lm": "launcher.tasks.stream_lm:stream_lm",
}
# Built-ins whose args can be checked before launch without torch: name -> "module:function(args)".
ARG_CHECKS = {
    "hf_causal_lm": "launcher.tasks.hf_args:parse",
    "stream_lm": "launcher.tasks.stream_lm_args:parse",
}


@dataclass
class Task:
    model: Any
    dataset: Any
    loss_fn: Callable
    collate_fn: Callable | None = None
    count_fn: Callable | None = None  # batch -> elements (tokens) without a forward; plans token-keyed schedules
    length_fn: Callable | None = None  # sample -> elements (tokens); preferred by planning over count_fn
    val_dataset: Any = None  # held-out samples (same form as dataset), or None; see launcher/train/evaluate.py
    val_loss_fn: Callable | None = None  # default: loss_fn
    metrics_fn: Callable | None = None  # (model, batch) -> {name: (sum, count)}
    save_fn: Callable | None = None  # (state_dict, output_dir) -> None on rank 0 after model.pt: the task's export


def resolve(target: str) -> tuple[str, str]:
    """``(module, function)`` for a target, built-ins mapped to their module."""
    module, _, function = target.partition(":")
    if module == "builtin":
        if function not in BUILTINS:
            raise ConfigError("task.target", f"no built-in task {function!r}",
                              f"use one of {', '.join('builtin:' + b for b in BUILTINS)}")
        module, _, function = BUILTINS[function].partition(":")
    return module, function


def check_target(target: str) -> None:
    """Raise ConfigError if the module cannot be found or does not define the function (no import of it)."""
    module, function = resolve(target)
    ensure_cwd_on_path()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        spec, reason = None, str(exc)
    else:
        reason = "no such module"
    if spec is None:
        raise ConfigError("task.target", f"cannot import module {module!r} ({reason})",
                          "check the module path, and run from the directory that contains it or install it")
    origin = spec.origin
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return  # compiled or namespace module: checked when the workers import it
    with open(origin, encoding="utf-8") as f:
        try:
            tree = ast.parse(f.read(), origin)
        except SyntaxError as exc:
            raise ConfigError("task.target", f"module {module!r} has a syntax error at line {exc.lineno}: {exc.msg}",
                              f"fix {origin}") from None
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.AnnAssign,)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if function not in names and "__getattr__" not in names:
        raise ConfigError("task.target", f"module {module!r} has no function {function!r}",
                          f"define {function}(**args) in {origin} or fix the name after ':'")


def check_args(target: str, args: dict) -> None:
    """Raise ConfigError for bad ``task.args`` that can be told before launch (no torch import): a built-in's own
    checks, and a key the task function takes no parameter for (read from its source, not imported)."""
    module, _, function = target.partition(":")
    if module == "builtin" and function in ARG_CHECKS:
        check_module, _, check = ARG_CHECKS[function].partition(":")
        getattr(importlib.import_module(check_module), check)(args)
    accepted = _parameters(target)
    if accepted is None:
        return
    for name in args:
        if name not in accepted:
            close = difflib.get_close_matches(str(name), accepted, n=1, cutoff=0.6)
            known = ", ".join(accepted) or "none"
            raise ConfigError(f"task.args.{name}", f"{target} takes no argument {name!r}",
                              f"did you mean {close[0]!r}? (its arguments: {known})" if close
                              else f"its arguments: {known}")


def _parameters(target: str) -> list[str] | None:
    """The keyword parameters of the task function as its source defines it; None when it takes ``**kwargs`` or
    its source cannot be read (then the workers' call is the check)."""
    module, function = resolve(target)
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    with open(origin, encoding="utf-8") as f:
        try:
            tree = ast.parse(f.read(), origin)
        except SyntaxError:
            return None
    found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    if len(found) != 1 or found[0].args.kwarg is not None:
        return None
    params = found[0].args
    return [a.arg for a in (*params.args, *params.kwonlyargs)]


def build(target: str, args: dict) -> Task:
    """Import the target and call it with ``args``; normalise what it returns into a Task."""
    module_name, function = resolve(target)
    ensure_cwd_on_path()
    module = importlib.import_module(module_name)
    try:
        factory = getattr(module, function)
    except AttributeError:
        raise ConfigError("task.target", f"module {module_name!r} has no function {function!r}",
                          "fix the name after ':'") from None
    made = factory(**args)
    get = made.get if isinstance(made, dict) else (lambda k, d=None: getattr(made, k, d))
    missing = [k for k in ("model", "dataset", "loss_fn") if get(k) is None]
    if missing:
        raise ConfigError("task.target", f"{target} returned no {', '.join(missing)}",
                          "return a mapping with model, dataset, loss_fn (and optionally collate_fn)")
    return Task(model=get("model"), dataset=get("dataset"), loss_fn=get("loss_fn"), collate_fn=get("collate_fn"),
                count_fn=get("count_fn"), length_fn=get("length_fn"), val_dataset=get("val_dataset"),
                val_loss_fn=get("val_loss_fn"), metrics_fn=get("metrics_fn"), save_fn=get("save_fn"))
