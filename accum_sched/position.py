"""The counters a window's factor may depend on, and epoch lengths: shared by the schedule and the planner.

Its own module so that :mod:`accum_sched.schedule` and :mod:`accum_sched.planning` both import it and neither
imports the other's importer (the imports form a DAG). Standard library only.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    """The counters a window's factor may depend on, all global (identical on every rank) at a window start."""

    epoch: int = 0
    step: int = 0
    samples: int = 0
    tokens: int = 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def per_epoch(batches_per_epoch: int | Iterable[int], epochs: int) -> list[int]:
    if _is_int(batches_per_epoch):
        if batches_per_epoch < 0:
            raise ValueError(f"batches_per_epoch must be >= 0, got {batches_per_epoch}")
        return [batches_per_epoch] * epochs
    counts = list(batches_per_epoch)
    if len(counts) != epochs:
        raise ValueError(f"batches_per_epoch has {len(counts)} entries for {epochs} epochs; give one per epoch")
    if any(not _is_int(n) or n < 0 for n in counts):
        raise ValueError("batches_per_epoch entries must be integers >= 0")
    return counts
