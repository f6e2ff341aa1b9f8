"""The one place that chooses a back end: an ordered table of (name, "is this model mine?", where the class lives).

The first entry whose predicate accepts the model wins, so the more specific come first (a DeepSpeed engine or an
FSDP2 root before DDP; the one-process back end takes whatever is left and refuses what it cannot run). Predicates
import nothing heavy (:mod:`.detect`) and a back end's module is imported only once it is chosen, so neither
DeepSpeed nor FSDP2 is imported for a DDP or one-process model. Adding a back end: its module, and one line here.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from accum_sched.backends.base import Backend, check_precision
from accum_sched.backends.detect import is_ddp, is_deepspeed_engine, is_fsdp2_root


@dataclass(frozen=True)
class Entry:
    """One registered back end."""

    name: str
    claims: Callable[[object], bool]  # is this model mine? (cheap, imports nothing a rival back end needs)
    path: str  # "module:Class", imported when chosen

    def load(self) -> type[Backend]:
        module, _, cls = self.path.partition(":")
        return getattr(importlib.import_module(module), cls)


REGISTRY: list[Entry] = [
    Entry("deepspeed", is_deepspeed_engine, "accum_sched.backends.deepspeed:DeepSpeedBackend"),
    Entry("fsdp2", is_fsdp2_root, "accum_sched.backends.fsdp:FSDPBackend"),
    Entry("ddp", is_ddp, "accum_sched.backends.ddp:DDPBackend"),
    Entry("single", lambda model: True, "accum_sched.backends.single:SingleProcessBackend"),
]


def backend_class(model) -> type[Backend]:
    """The class of the back end ``model`` gets (the first registered entry that claims it)."""
    for entry in REGISTRY:
        if entry.claims(model):
            return entry.load()
    raise ValueError(f"no back end accepts a {type(model).__name__}")  # unreachable while "single" claims all


def options_of(cls: type[Backend]) -> tuple[str, ...]:
    """The keyword options a back end class takes (its keyword-only constructor parameters)."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def check_options(cls: type[Backend], options: dict) -> None:
    """One TypeError line for an option ``cls`` does not take, naming it, the back end and what it does take."""
    allowed = options_of(cls)
    for name in options:
        if name not in allowed:
            raise TypeError(f"{name}= is not an option of the {cls.name} back end ({cls.__name__}), chosen for this "
                            f"model; it takes {', '.join(allowed)}")


def make_backend(model, optimizer=None, lr_scheduler=None, **options) -> Backend:
    """The back end for ``model`` (a DeepSpeed engine, an FSDP2 root, a DDP module, or a plain module in one
    process), built with ``options``: ``precision`` for every back end, and the chosen class's own (DDP:
    ``count_allreduce``; FSDP2: ``gradient_sync``, ``keep_gathered``). An option that class does not take is a
    TypeError naming it."""
    cls = backend_class(model)
    check_options(cls, options)
    return cls(model, optimizer, lr_scheduler, **options)


def resolve_backend(model, optimizer, lr_scheduler, backend: Backend | None, precision: str | None,
                    options: dict) -> Backend:
    """The engine's back end: ``backend`` as the caller built it (then ``optimizer``, ``lr_scheduler`` and
    ``options`` are its own and must not be given again, and ``precision``, if given, must be the one it was built
    with), or the one :func:`make_backend` picks for ``model``, built with ``precision`` and ``options``."""
    if backend is None:
        if precision is not None:
            options = {"precision": check_precision(precision), **options}
        return make_backend(model, optimizer, lr_scheduler, **options)
    given = [name for name, value in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)) if value is not None]
    if given or options:
        raise TypeError(f"{', '.join(given + list(options))} belong to the back end when backend= is given: pass "
                        f"them to {type(backend).__name__}(...)")
    if precision is not None and check_precision(precision) != backend.precision:
        raise ValueError(f"precision={precision!r} but the back end was built with precision={backend.precision!r}: "
                         f"give it once, to the back end")
    return backend


__all__ = ["REGISTRY", "Entry", "backend_class", "check_options", "make_backend", "options_of", "resolve_backend"]
