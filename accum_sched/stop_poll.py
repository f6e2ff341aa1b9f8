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
and a stop still lands within 2 micro-batches of the request. Each window counts its calls afresh: with ``every``
k its polls sit at its k-th, 2k-th, ... micro-batches, and a window of up to 2k starts none.

``min_ms`` (``stop_poll_min_ms``; 0: off) floors the time between polls instead of their count: at each window's end
the ranks' micro-batch times ride in the window's numbers (:meth:`stamp`, summed there with no collective of their
own) and every rank derives the same ``every`` from their sum (:meth:`agree`): at least ``stop_poll_every``, and
enough micro-batches to span ``min_ms`` on the ranks' mean. A window is timed inside itself, from its first
micro-batch's end to its last backward (the step and whatever runs between windows are left out), so windows of 1
or 2 micro-batches, which start no poll anyway, measure nothing and change nothing. Where micro-batches take longer
than ``min_ms`` nothing changes; where they take a few milliseconds the poll's all-reduces fall to about one per
``min_ms`` and a stop lands within about ``2 x min_ms`` of training (or at the window's boundary, if that comes
sooner). An engine's first window of 3 or more micro-batches polls at ``stop_poll_every`` while it is measured.
"""
from __future__ import annotations

import math
import time

import torch

from accum_sched import collective


class StopPoll:
    """``poll(requested)`` once per micro-batch on every rank; True (on every rank at once) when some rank asked.
    ``every``: communicate on every this many calls only (a cheaper poll, a later stop); ``min_ms``: and on no more
    calls than span that many milliseconds of training (see the module's text)."""

    def __init__(self, world_size: int, every: int = 1, min_ms: float = 0.0):
        self.world_size, self.every, self.base_every, self.min_ms = world_size, every, every, min_ms
        self._timed = world_size > 1 and min_ms > 0
        self._window_t0, self._window_calls = None, 0  # the open window's first poll call: its time, calls since
        self._calls = 0  # polls since the last one that communicated (the same on every rank)
        self._asked = False  # a request seen on a call that did not communicate, for the next one that does
        self.group = collective.side_group() if world_size > 1 else None
        self._flag: torch.Tensor | None = None
        self._work = None

    @classmethod
    def when(cls, stop_at: str, world_size: int, every: int, min_ms: float) -> StopPoll | None:
        """The engine's poll: one for ``stop_at="micro_batch"``, None for ``"boundary"`` (the window's numbers)."""
        return cls(world_size, every, min_ms) if stop_at == "micro_batch" else None

    @property
    def interval(self) -> int:
        """Micro-batches between two reads of the stop flag now: ``every`` (1 in one process: read at each one)."""
        return 1 if self.world_size == 1 else self.every

    def poll(self, requested: bool, left: int | None = None) -> bool:
        """On every ``every``-th call: the answer to the poll started ``every`` calls earlier (False on the first);
        starts the next unless it is True or it would be read after the window's end (``left``: the micro-batches
        the window has after this one, the same on every rank; None: no window). Other calls: False, nothing
        communicated. ``left`` 0 (a window's last micro-batch): False, and the count starts again with the next
        window (a request not yet sent went in the window's numbers)."""
        if self.world_size == 1:
            return requested
        if left == 0:  # the boundary: the next window counts its calls afresh (its polls at its k-th, 2k-th, ...)
            self._calls, self._asked, self._window_t0 = 0, False, None
            return False
        if self._timed:  # time the window from its first micro-batch's end (the step and data between windows aside)
            if self._window_t0 is None:
                self._window_t0, self._window_calls = time.perf_counter(), 0
            else:
                self._window_calls += 1
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

    def stamp(self) -> int:
        """This rank's mean micro-batch time in the window ending now, in microseconds, for its numbers (called at the
        window's last backward, before its poll call); 0 when not measured (a window of 1 or 2, or no floor)."""
        if not self._timed or self._window_t0 is None or self._window_calls == 0:
            return 0
        return max(1, round((time.perf_counter() - self._window_t0) * 1e6 / self._window_calls))

    def agree(self, summed_us: float) -> None:
        """Set ``every`` from the sum over ranks of :meth:`stamp` (the same on every rank, hence the same ``every``);
        a sum of 0 (not known) keeps it."""
        if self._timed and summed_us > 0:
            mean_us = summed_us / self.world_size
            self.every = max(self.base_every, math.ceil(self.min_ms * 1000.0 / mean_us))

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
