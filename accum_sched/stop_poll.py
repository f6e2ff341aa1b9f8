"""StopPoll: the ranks agree on a stop request while training runs, without waiting for it (``stop_at="micro_batch"``).

Every ``every``-th micro-batch (default: each one) a poll reads the sum started by the previous poll and starts the
next, so the all-reduce of one number overlaps ``every`` micro-batches. All ranks poll at the same micro-batches and
see the same sums in the same order, hence stop after the same micro-batch: at most ``2 x every`` micro-batches after
the request reached a rank (the request joins the next poll, whose answer the poll after it reads). The flag is a
CPU tensor on a gloo group of its own (:func:`collective.side_group`), so reading it is no device sync under NCCL.
In one process the flag is read directly, at every micro-batch.

The engine tells each poll how many micro-batches its window has left (``left``). At a window's last micro-batch
(``left`` 0) nothing is polled: the stop flag rides in the window's numbers (:mod:`accum_sched.window_stats`), which
the step sums on every rank anyway, so a stop requested before it lands at that boundary. Nor is a poll started
whose answer would be read after that boundary (with ``every`` 1: the one at a window's last-but-one micro-batch):
the boundary answers sooner. So a window of ``f`` micro-batches starts ``f - 2`` polls (none at factors 1 and 2),
and a stop still lands within 2 micro-batches of the request.
"""
from __future__ import annotations

import torch

from accum_sched import collective


class StopPoll:
    """``poll(requested)`` once per micro-batch on every rank; True (on every rank at once) when some rank asked.
    ``every``: communicate on every this many calls only (a cheaper poll, a later stop)."""

    def __init__(self, world_size: int, every: int = 1):
        self.world_size, self.every = world_size, every
        self._calls = 0  # polls since the last one that communicated (the same on every rank)
        self._asked = False  # a request seen on a call that did not communicate, for the next one that does
        self.group = collective.side_group() if world_size > 1 else None
        self._flag: torch.Tensor | None = None
        self._work = None

    def poll(self, requested: bool, left: int | None = None) -> bool:
        """On every ``every``-th call: the answer to the poll started ``every`` calls earlier (False on the first);
        starts the next unless it is True or it would be read after the window's end (``left``: the micro-batches
        the window has after this one, the same on every rank; None: no window). Other calls: False, nothing
        communicated. ``left`` 0 (a window's last micro-batch): False, and the call does not count."""
        if self.world_size == 1:
            return requested
        if left == 0:
            return False
        self._calls += 1
        self._asked = self._asked or requested
        if self._calls < self.every:
            return False
        self._calls, requested, self._asked = 0, self._asked, False
        agreed = self.drain()
        if not agreed and (left is None or left > self.every):  # read at the every-th call from now
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
