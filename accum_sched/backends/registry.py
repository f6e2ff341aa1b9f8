"""The one place that chooses a back end: an ordered table of (name, "is this model mine?", where the class lives).

The first entry whose predicate accepts the model wins, so the more specific come first (a DeepSpeed engine or an
FSDP2 root before DDP; the one-process back end takes whatever is left and refuses what it cannot run). Predicates
import nothing heavy (:mod:`.detect`) and a back end's module is imported only once it is chosen, so neither
DeepSpeed nor FSDP2 is imported for a DDP or one-process model. Adding a back end: its module, and one line here.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from accum_sched.backends.base import Backend, BackendOptions
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


def make_backend(model, optimizer=None, lr_scheduler=None, *, precision: str = "fp32", count_allreduce: bool = True,
                 gradient_sync: str = "boundary", keep_gathered: bool = False) -> Backend:
    """The back end for ``model``: a DeepSpeed engine, an FSDP2 root, a DDP module, or a plain module in one
    process. ``precision="fp16"`` gives torch back ends a GradScaler; ``gradient_sync`` (FSDP2 only):
    ``"boundary"``, ``"every_micro_batch"`` or ``"reduce_scatter"``, and ``keep_gathered``."""
    options = BackendOptions(precision=precision, count_allreduce=count_allreduce, gradient_sync=gradient_sync,
                             keep_gathered=keep_gathered)
    return backend_class(model)(model, optimizer, lr_scheduler, options)


__all__ = ["REGISTRY", "Entry", "backend_class", "make_backend"]
