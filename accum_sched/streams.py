"""Where a stream ends: micro-batches from an iterable without ``len()``, each known in advance to be the epoch's last
or not, on every rank alike.

The epoch of a stream ends where the shortest rank's stream ends. Whether micro-batch ``i`` is the last must be known
before its forward (it decides the gradient-sync context and the window's boundary), so the reader keeps micro-batches
read ahead, at most ``read_ahead + 1`` (R + 1) of them, and the ranks agree, per batch of reads, whether all ranks,
or only some, have each of them (MAX of ``[has, -has]`` per read).

Where that agreement travels:

* **In the window's numbers** (the engine's path, :meth:`StreamReader.next` told ``boundary``). At each optimizer
  boundary that is not the epoch's last micro-batch the reader tops what it holds up to R + 1, and this rank's one
  flag "I lack one of these" joins the numbers the window sums anyway (:mod:`accum_sched.window_stats`: inside the
  gradient all-reduce under DDP, in the step's one small all-reduce elsewhere). Every rank reads the sum at the step;
  zero (every rank holds them all, the usual case) settles the batch with no collective of its own. Otherwise
  (the shortest stream ends inside the batch) one all-reduce of the batch's flags says exactly where
  (:meth:`StreamReader.settle`); after that the end is known and nothing more is read. At factors up to R an epoch
  then costs two such collectives: the first batch's, and the one where the end comes into view.
* **On its own**, one small asynchronous all-reduce (int64 on the side gloo group, CPU tensors: no device sync under
  NCCL): the epoch's first R + 1 reads, and, when a window is longer than what is held (factor > R), R more reads
  whenever what it holds drops to one micro-batch. The answer for ``i + 1`` is waited for when ``i`` is handed out;
  it was started at least one micro-batch earlier, so it ran while that one computed. Without ``boundary`` (a
  reader used on its own) this is the only path: ``1 + (n - 1) // R`` collectives for ``n >= 1`` micro-batches.

A loader whose length is known costs none of this (the map-style path agrees on the length once per epoch). The
engine's default is :data:`READ_AHEAD`.
"""
from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist

from accum_sched import collective

READ_AHEAD = 4  # the engine's default: 5 micro-batches held at most
UNEVEN_HINT = ("give every rank a stream of the same length (shard it evenly) or set uneven='truncate', which "
               "ends the epoch where the shortest stream ends")


class StreamReader:
    """``next()`` gives ``(batch, last)``, ``last`` True on every rank for the epoch's final micro-batch; None once
    the epoch is over. ``uneven``: 'truncate' (warn once on rank 0, end at the shortest) or 'error' (raise
    :class:`accum_sched.collective.RankDisagreement` on every rank at the first micro-batch some rank lacks).
    ``read_ahead``: R in the module's doc. ``first_index``: the epoch's micro-batches before the iterator's first
    (a resumed epoch), so messages count the epoch's micro-batches.

    With ``next(boundary=True)``, :attr:`short` is this rank's flag for the reads that ride in the window's numbers,
    and :meth:`settle` must be called on every rank with their sum before the next ``next()``."""

    def __init__(self, iterator: Iterator, *, uneven: str = "truncate", context: str = "", read_ahead: int = 1,
                 first_index: int = 0):
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 1:
            raise ValueError(f"read_ahead={read_ahead!r} must be an int >= 1")
        self._it = iterator
        self._chunk = read_ahead
        self._exhausted = False
        self._uneven = uneven
        self._context = context
        self._warned = False
        self._group = collective.side_group() if collective.is_distributed() else None
        # read ahead, oldest first: [batch or None, its has-flag's place in the flags, the _Flags it rides in]
        self._ahead: deque = deque()
        self.read = 0  # micro-batches this rank has taken from the iterator
        self.collectives = 0  # asynchronous all-reduces started
        self._index = 0  # of the next micro-batch handed out
        self._first = first_index
        self._end_known = False  # an agreed batch of reads shows where the shortest stream ends: read no more
        self._riding: _Flags | None = None  # reads whose flag rides in the window's numbers, until settle()
        self.short = False  # this rank lacks one of those reads
        self._fill(read_ahead + 1)

    def _read(self, count: int) -> tuple[list, list[int]]:
        """Up to ``count`` micro-batches (None past the end) and their has-flags."""
        batches, has = [], []
        for _ in range(count):
            batch, got = None, 0
            if not self._exhausted:
                try:
                    batch, got = next(self._it), 1
                    self.read += 1
                except StopIteration:
                    self._exhausted = True
            batches.append(batch)
            has.append(got)
        return batches, has

    def _fill(self, count: int) -> None:
        """Read ``count`` micro-batches and start one all-reduce of their has-flags."""
        batches, has = self._read(count)
        self._hold(batches, _Flags(has, self._group))

    def _hold(self, batches: list, flags: _Flags) -> None:
        self.collectives += flags.work is not None
        for i, batch in enumerate(batches):
            self._ahead.append((batch, i, flags))

    def _ride(self) -> None:
        """At a boundary: top what is held up to R + 1; the reads' flag rides in the window's numbers."""
        count = self._chunk + 1 - len(self._ahead)
        if self._end_known or count <= 0:
            return
        batches, has = self._read(count)
        self._riding = _Flags(has, None)  # reduced by the window's numbers (see settle)
        self.short = 0 in has
        self._hold(batches, self._riding)

    def settle(self, some_short: bool) -> None:
        """The sum of every rank's :attr:`short` at the boundary (the same on every rank) is known: ``False``: every
        rank holds every read of the batch; ``True``: one all-reduce of the batch's flags says which."""
        flags, self._riding, self.short = self._riding, None, False
        if flags is None:
            return
        if some_short:
            self._end_known = True
            flags.start(self._group)
            self.collectives += flags.work is not None
        else:
            flags.agree_everyone_has()

    def _present(self, position: int) -> bool:
        """Whether every rank holds the micro-batch at ``position`` of the queue (waits for its all-reduce)."""
        _, slot, flags = self._ahead[position]
        high, low = flags.ranges(slot)
        self._end_known = self._end_known or flags.some_missing  # the same on every rank
        if high != low:
            message = (f"{self._context}: the ranks' streams end at different points (micro-batch "
                       f"{self._first + self._index + position} of the epoch is on some ranks only)")
            if self._uneven == "error":
                raise collective.RankDisagreement(message + "; " + UNEVEN_HINT)
            if not self._warned and collective.rank() == 0:
                warnings.warn(message + "; every rank stops at the shortest (uneven='truncate')", stacklevel=4)
            self._warned = True
        return low == 1

    def next(self, boundary: bool = False):
        """``(batch, last)``, or None once the epoch is over. ``boundary``: the caller's window ends at this
        micro-batch, and :meth:`settle` follows before the next call (the reads ride in the window's numbers)."""
        if self._riding is not None:
            raise RuntimeError("StreamReader.settle() must follow a boundary before the next micro-batch")
        if not self._ahead or not self._present(0):
            self.close()
            return None
        last = not self._present(1)
        batch = self._ahead.popleft()[0]
        self._index += 1
        if last:
            self.close()
        elif boundary:
            self._ride()
        elif len(self._ahead) <= 1 and not self._end_known:  # only the next one left: read on, flags in flight
            self._fill(self._chunk)
        return batch, last

    def close(self) -> None:
        """Wait for what is still in flight (every rank started the same ones) and drop the read-ahead."""
        for _, _, flags in self._ahead:
            flags.wait()
        self._ahead.clear()
        self._riding, self.short = None, False


class _Flags:
    """The has-flags of a batch of reads, MAX-reduced over ranks (asynchronously where there are ranks), or, for
    reads that ride in the window's numbers, settled by :meth:`agree_everyone_has` / :meth:`start`."""

    def __init__(self, has: list[int], group):
        self.flags = torch.tensor(has + [-h for h in has], dtype=torch.int64)
        self._values: list[int] | None = None  # the reduced flags, read once (a host tensor: no device sync)
        self.some_missing = False  # once read: some rank lacks one of the reads (the end is in view)
        self.work = None
        self.start(group)

    def start(self, group) -> None:
        if group is not None:
            self.work = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def agree_everyone_has(self) -> None:
        k = len(self.flags) // 2
        self._values = [1] * k + [-1] * k

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def ranges(self, slot: int) -> tuple[int, int]:
        """(the most, the least) ranks' has-flag for read ``slot``: (1, 1) all have it, (1, 0) some, (0, 0) none."""
        values = self._values
        k = len(self.flags) // 2
        if values is None:  # one read of the block's flags, not two tensor reads per question (two per micro-batch)
            self.wait()
            values = self._values = self.flags.tolist()
            self.some_missing = min(-v for v in values[k:]) == 0
        return values[slot], -values[k + slot]


def has_length(loader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True
