"""StopPoll: the ranks agree on a stop request once per micro-batch without waiting for it (``stop_at="micro_batch"``).

Each poll reads the sum started by the previous one and starts the next, so the all-reduce of one number overlaps a
whole micro-batch. All ranks see the same sums in the same order, hence stop after the same micro-batch (one after
the request reached a rank). The flag is a CPU tensor on a gloo group of its own (:func:`collective.side_group`), so
reading it is no device sync under NCCL. In one process the flag is read directly.
"""
from __future__ import annotations

import torch

from accum_sched import collective


class StopPoll:
    """``poll(requested)`` once per micro-batch on every rank; True (on every rank at once) when some rank asked."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.group = collective.side_group() if world_size > 1 else None
        self._flag: torch.Tensor | None = None
        self._work = None

    def poll(self, requested: bool) -> bool:
        """The answer to the poll started one call earlier (False on the first); starts the next unless it is True."""
        if self.world_size == 1:
            return requested
        agreed = self.drain()
        if not agreed:
            self._flag = torch.tensor([float(requested)], dtype=torch.float64)
            self._work = collective.all_sum_async(self._flag, group=self.group)
        return agreed

    def drain(self) -> bool:
        """Wait for the poll in flight, if any; True if some rank had asked to stop."""
        if self._flag is None:
            return False
        if self._work is not None:
            self._work.wait()
        agreed = bool(self._flag.item() > 0)  # a CPU tensor on a gloo group: no device sync
        self._flag = self._work = None
        return agreed


__all__ = ["StopPoll"]
