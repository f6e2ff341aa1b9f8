"""Where an epoch's micro-batches come from, for the engine's one micro-batch loop: a loader whose length the ranks
agreed on (:class:`SizedFeed`), or a stream without ``len()`` whose end they agree on as it comes
(:class:`StreamFeed`, over :class:`accum_sched.streams.StreamReader`).

Both answer ``next(boundary)`` with ``(batch, last)`` (``last``: the epoch's final micro-batch, known before its
forward on every rank) or None once the epoch is over, and drop what a resume already trained when asked to
(``skip``). ``boundary`` says the engine's window ends at that micro-batch: a stream then reads on, and its
:attr:`short` flag rides in the window's numbers, whose sum the engine hands to ``settle()`` after the step.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch

from accum_sched import collective, streams

_END = object()


def batch_size(batch) -> int:
    """Samples in a micro-batch: the leading dimension of its first tensor."""
    if type(batch) in (list, tuple) and batch and type(batch[0]) is torch.Tensor and batch[0].dim():  # (x, y, ...)
        return batch[0].shape[0]
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        for value in batch.values():
            return batch_size(value)
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (torch.Tensor, dict, list, tuple)):
            return batch_size(first)
        return len(batch)
    return 1


def agreed_length(ranges: dict, num_batches: int, start: int, factor: int, epoch: int, uneven: str) -> int:
    """The micro-batches every rank trains, from the epoch-start agreement's ``ranges`` (warns on rank 0, or raises
    under ``uneven='error'``, when the ranks' lengths differ)."""
    low, high = ranges["micro-batches per epoch"]
    if low != high:
        message = f"epoch {epoch}: ranks have between {low} and {high} micro-batches (this rank {num_batches})"
        if uneven == "error":
            raise collective.RankDisagreement(message + "; give every rank the same number (DistributedSampler "
                                              "pads to equal lengths) or set uneven='truncate'")
        if collective.rank() == 0:
            warnings.warn(message + f"; every rank trains the first {low} (uneven='truncate')", stacklevel=4)
    if low < factor and collective.rank() == 0 and low > start:
        warnings.warn(f"epoch {epoch} has {low} micro-batches, fewer than the factor {factor}: it takes one "
                      f"optimizer step over all of them", stacklevel=4)
    return low


class SizedFeed:
    """The first ``total`` micro-batches of an epoch (agreed by every rank), from micro-batch ``start`` on.

    ``skip``: the loader yields the whole epoch, and the first ``start`` are read and dropped; otherwise it starts
    at ``start`` already. ``promised``: what ``len()`` said (for the message when the loader ends early)."""

    short = False  # nothing read ahead: nothing rides in the window's numbers

    def __init__(self, loader: Iterable, total: int, start: int, skip: bool, promised: int, epoch: int):
        self.total, self.position, self.promised, self.epoch = total, start, promised, epoch
        self._it = iter(loader) if start < total else iter(())
        if skip:
            for _ in range(start if start < total else 0):  # trained before the checkpoint: loaded and dropped
                next(self._it)

    @property
    def ended(self) -> bool:
        return self.position >= self.total

    def next(self, boundary: bool = False):
        if self.ended:
            return None
        try:
            batch = next(self._it)
        except StopIteration:
            raise RuntimeError(f"epoch {self.epoch}: the loader ended after {self.position} micro-batches but "
                               f"len() promised {self.promised}") from None
        self.position += 1
        return batch, self.ended

    def settle(self, some_short: bool) -> None:
        pass

    def close(self) -> None:
        pass


class StreamFeed:
    """An epoch of a stream: it ends where the shortest rank's does, as :class:`~accum_sched.streams.StreamReader`
    says one micro-batch ahead on every rank. ``count(n)`` is told of each ``n`` end-agreement all-reduces."""

    def __init__(self, loader: Iterable, start: int, skip: bool, epoch: int, *, uneven: str, read_ahead: int,
                 count: Callable[[int], None]):
        iterator = iter(loader)
        if skip:
            for _ in range(start):  # trained before the checkpoint: loaded and dropped
                if next(iterator, _END) is _END:
                    break
        self._count = count
        # first_index: the epoch's micro-batches before a resume point count too (the uneven-stream message names
        # the epoch's micro-batch, not the session's)
        self._reader = streams.StreamReader(iterator, uneven=uneven, context=f"epoch {epoch}", read_ahead=read_ahead,
                                            first_index=start)
        self._counted = self._reader.collectives
        count(self._counted)
        self.ended = False

    @property
    def short(self) -> bool:
        return self._reader.short

    def next(self, boundary: bool = False):
        if self.ended:
            return None
        item = self._reader.next(boundary)
        self._recount()
        self.ended = item is None or item[1]
        return item

    def settle(self, some_short: bool) -> None:
        self._reader.settle(some_short)
        self._recount()

    def _recount(self) -> None:
        if self._reader.collectives != self._counted:
            self._count(self._reader.collectives - self._counted)
            self._counted = self._reader.collectives

    def close(self) -> None:
        self._reader.close()


__all__ = ["SizedFeed", "StreamFeed", "agreed_length", "batch_size"]
