"""Deliberately broken engines for the mutation check (bench/mutation.py): the tests must fail against each.

A mutant is applied without touching product code: bench/mutation.py writes a ``sitecustomize.py`` into a temporary
directory that it puts first on PYTHONPATH, so every interpreter of a test run (pytest, spawned ranks, torchrun
workers) runs :func:`install` at start-up. ``install`` adds an import hook that patches ``accum_sched.engine`` right
after it is executed; nothing is imported before that (``accum-sched check`` still starts without torch).

Each mutant patches :class:`AccumulationEngine` only (not a back end), by wrapping a method or by rewriting one line
of a method's source; a rewrite whose line is gone raises :class:`MutantDidNotApply` at import, so a mutant can
never pass silently because the engine changed under it. This module imports nothing outside the standard library.
"""
from __future__ import annotations
import __future__

import importlib.abc
import inspect
import sys
import textwrap

TARGET = "accum_sched.engine"


class MutantDidNotApply(ImportError):
    """The line a mutant rewrites is not in the engine any more: update the mutant."""


def _rewrite(cls, name: str, module, old: str, new: str) -> None:
    """Replace ``old`` (exactly once) by ``new`` in the source of ``cls.name``, compiled in the engine's globals."""
    source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
    if source.count(old) != 1:
        raise MutantDidNotApply(f"{cls.__name__}.{name} holds {source.count(old)} copies of {old!r}, not 1")
    code = compile(source.replace(old, new), module.__file__, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    scope: dict = {}
    exec(code, module.__dict__, scope)  # noqa: S102 - the engine's own source, one line changed
    setattr(cls, name, scope[name])


def partial_divisor_rank1(module) -> None:
    """(a) Rank 1 only divides a partial window's gradient by a full window's count (factor / size too small)."""
    engine = module.AccumulationEngine
    original = engine._coefficient

    def _coefficient(self, size, elements):
        coef = original(self, size, elements)
        if size < self.factor and module.collective.rank() == 1:
            return coef * size / self.factor
        return coef

    engine._coefficient = _coefficient


def late_boundary(module) -> None:
    """(b) Off by one: every window takes one micro-batch more, so each step comes one micro-batch late."""
    _rewrite(module.AccumulationEngine, "micro_batches", module,
             "min(factor, total - consumed)", "min(factor + 1, total - consumed)")


def forward_outside_no_sync(module) -> None:
    """(c) Only the backward runs in the back end's sync context: under DDP the forward of a non-boundary
    micro-batch, outside ``no_sync()``, arms the reducer, so every micro-batch all-reduces."""
    engine = module.AccumulationEngine
    _rewrite(engine, "_micro_batch", module,
             "with self.backend.sync_context(boundary):", "with contextlib.nullcontext():")
    original = engine.backward

    def backward(self, loss_sum, n_elements):
        with self.backend.sync_context(self._boundary):
            return original(self, loss_sum, n_elements)

    engine.backward = backward


def no_agreement(module) -> None:
    """(d) The epoch-start agreement is skipped: each rank trusts its own factor, schedule and epoch length."""

    def agree_locally(named, *, context="", allow=()):
        return {k: (int(v), int(v)) for k, v in named.items()}

    module._mutant_agree_locally = agree_locally
    _rewrite(module.AccumulationEngine, "_agree_epoch", module, "collective.agree(", "_mutant_agree_locally(")


MUTANTS = {
    "a": ("partial divisor, rank 1 only", partial_divisor_rank1),
    "b": ("boundary one micro-batch late", late_boundary),
    "c": ("forward outside no_sync", forward_outside_no_sync),
    "d": ("no rank agreement", no_agreement),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``accum_sched.engine`` through the other finders and patches the module once it has executed."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        execute, patch = spec.loader.exec_module, MUTANTS[self.name][1]

        def exec_module(module):
            execute(module)
            patch(module)
            module._ACCUM_SCHED_MUTANT = self.name  # bench/mutation.py checks that the mutant is in place

        spec.loader.exec_module = exec_module
        return spec


def install(name: str) -> None:
    """Patch the engine with mutant ``name`` (a key of MUTANTS) when it is imported."""
    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r}; one of {', '.join(MUTANTS)}")
    sys.meta_path.insert(0, _PatchAfterImport(name))
