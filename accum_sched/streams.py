"""Where a stream ends: micro-batches from an iterable without ``len()``, each known in advance to be the epoch's last
or not, on every rank alike.

The epoch of a stream ends where the shortest rank's stream ends. Whether micro-batch ``i`` is the last must be known
before its forward (it decides the gradient-sync context and the window's boundary), so the reader keeps micro-batches
read ahead, ``read_ahead`` (R) of them at a time: it starts with R + 1 reads, and whenever what it holds drops to one
micro-batch it reads R more. Each batch of reads is followed by one small asynchronous all-reduce (MAX of ``[has,
-has]`` per read, int64 on the side gloo group, CPU tensors: no device sync under NCCL) that tells every rank whether
all ranks, or only some, have each of those micro-batches. The answer for ``i + 1`` is waited for when ``i`` is
handed out; it was started at least one micro-batch earlier, so it ran while that one computed. So an epoch of
``n >= 1`` micro-batches costs ``1 + (n - 1) // R`` such collectives (``n`` at R = 1) and holds at most R + 1
micro-batches ahead; a loader whose length is known costs none (the map-style path agrees on the length once per
epoch). The engine's default is :data:`READ_AHEAD`.
"""
from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist

from accum_sched import collective

READ_AHEAD = 4  # the engine's default: one end-agreement all-reduce per 4 micro-batches, 5 held at most
UNEVEN_HINT = ("give every rank a stream of the same length (shard it evenly) or set uneven='truncate', which "
               "ends the epoch where the shortest stream ends")


class StreamReader:
    """``next()`` gives ``(batch, last)``, ``last`` True on every rank for the epoch's final micro-batch; None once
    the epoch is over. ``uneven``: 'truncate' (warn once on rank 0, end at the shortest) or 'error' (raise
    :class:`accum_sched.collective.RankDisagreement` on every rank at the first micro-batch some rank lacks).
    ``read_ahead``: micro-batches read per all-reduce (see the module's doc). ``first_index``: the epoch's
    micro-batches before the iterator's first (a resumed epoch), so messages count the epoch's micro-batches."""

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
        self._fill(read_ahead + 1)

    def _fill(self, count: int) -> None:
        """Read ``count`` micro-batches (None past the end) and start one all-reduce of their has-flags."""
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
        flags = _Flags(torch.tensor(has + [-h for h in has], dtype=torch.int64), self._group)
        self.collectives += flags.work is not None
        for i, batch in enumerate(batches):
            self._ahead.append((batch, i, flags))

    def _present(self, position: int) -> bool:
        """Whether every rank holds the micro-batch at ``position`` of the queue (waits for its all-reduce)."""
        _, slot, flags = self._ahead[position]
        high, low = flags.ranges(slot)
        if high != low:
            message = (f"{self._context}: the ranks' streams end at different points (micro-batch "
                       f"{self._first + self._index + position} of the epoch is on some ranks only)")
            if self._uneven == "error":
                raise collective.RankDisagreement(message + "; " + UNEVEN_HINT)
            if not self._warned and collective.rank() == 0:
                warnings.warn(message + "; every rank stops at the shortest (uneven='truncate')", stacklevel=4)
            self._warned = True
        return low == 1

    def next(self):
        if not self._ahead or not self._present(0):
            self.close()
            return None
        last = not self._present(1)
        batch = self._ahead.popleft()[0]
        self._index += 1
        if last:
            self.close()
        elif len(self._ahead) <= 1:  # only the next one left: read the following ones, flags in flight meanwhile
            self._fill(self._chunk)
        return batch, last

    def close(self) -> None:
        """Wait for what is still in flight (every rank started the same ones) and drop the read-ahead."""
        for _, _, flags in self._ahead:
            flags.wait()
        self._ahead.clear()


class _Flags:
    """The has-flags of a batch of reads, MAX-reduced over ranks (asynchronously where there are ranks)."""

    def __init__(self, flags: torch.Tensor, group):
        self.flags = flags
        self._values: list[int] | None = None  # the reduced flags, read once (a host tensor: no device sync)
        self.work = None if group is None else dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group,
                                                               async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def ranges(self, slot: int) -> tuple[int, int]:
        """(the most, the least) ranks' has-flag for read ``slot``: (1, 1) all have it, (1, 0) some, (0, 0) none."""
        values = self._values
        if values is None:  # one read of the block's flags, not two tensor reads per question (two per micro-batch)
            self.wait()
            values = self._values = self.flags.tolist()
        k = len(values) // 2
        return values[slot], -values[k + slot]


def has_length(loader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True
