"""World-invariant windows: which samples each optimizer step sees does not depend on the number of ranks.

:class:`InvariantBatchSampler` lays an epoch's sample order (shuffled and seeded as ``DistributedSampler``: one
permutation per ``seed + epoch``) out in windows: window k is the next ``factor x world x micro_batch_size`` samples
of that order (the global batch; the epoch's last window may be partial). Each window's contiguous slice is split
over the ranks in contiguous pieces (sizes differ by at most one where it does not divide), and each rank's piece
into ``factor`` micro-batches (again by at most one sample, never more than ``micro_batch_size``). No sample is
padded or duplicated, so a rank may get short or empty micro-batches. Every rank still yields exactly ``factor``
micro-batches per window, so the engine's windows line up with the sampler's on every rank.

Keep ``factor x world`` fixed (the launcher's ``keep_global_batch``) and every step trains the same samples at any
world size: with the engine's exact normalisation (the window's loss sum over its global element count) the steps
are those of one process training full windows.

An empty micro-batch cannot be collated; :class:`InvariantCollate` turns it into an :class:`EmptyMicroBatch` that
holds one sample as filler. The engine runs the filler's forward and backward with the loss multiplied by zero and
an element count of zero (:meth:`accum_sched.AccumulationEngine.backward`): an exactly zero gradient, and every rank
still takes part in whatever collectives its forward and backward launch (DDP's all-reduce at the boundary). The
filler's forward does run: a model with batch statistics (BatchNorm's running mean) sees it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import Sampler, default_collate

from accum_sched.schedule import AccumulationSchedule


def split(count: int, parts: int) -> list[int]:
    """``count`` items in ``parts`` contiguous pieces whose sizes differ by at most one, the larger ones first."""
    base, extra = divmod(count, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's sample order: DistributedSampler's permutation (seeded with ``seed + epoch``) before it deals it."""
    if not shuffle:
        return list(range(size))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def window_bounds(samples: int, global_window: int, start: int = 0) -> list[tuple[int, int]]:
    """The ``(first, end)`` sample positions of each window of an epoch of ``samples`` from position ``start``."""
    return [(first, min(first + global_window, samples)) for first in range(start, samples, global_window)]


def rank_micro_batches(first: int, end: int, world: int, rank: int, factor: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s ``factor`` micro-batches of the window ``[first, end)``, as ``(first, end)`` positions."""
    pieces = split(end - first, world)
    start = first + sum(pieces[:rank])
    out = []
    for size in split(pieces[rank], factor):
        out.append((start, start + size))
        start += size
    return out


class InvariantBatchSampler(Sampler):
    """This rank's micro-batches (lists of dataset indices, some perhaps short or empty) of world-invariant windows.

    ``schedule``: the factor of each epoch: an int, or an epoch-keyed schedule (anything
    :class:`~accum_sched.AccumulationSchedule` takes); set it later with :meth:`set_schedule` if not known yet.
    Call :meth:`set_epoch` before each epoch, as for DistributedSampler. ``len()`` is the epoch's micro-batches on
    this rank (its windows times the factor, the same on every rank). :meth:`start_at_sample` starts the epoch's
    windows at a position of its order (a resume at a window boundary, on this world size or another).
    """

    def __init__(self, size: int, world: int, rank: int, micro_batch_size: int, schedule=1, *, shuffle: bool = True,
                 seed: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} must be in 0..{world - 1}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        self.size, self.world, self.rank, self.micro = size, world, rank, micro_batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.start = 0, 0
        self.set_schedule(schedule)

    def set_schedule(self, schedule) -> None:
        """The factor per epoch (only an epoch-keyed schedule fixes every window's factor before the epoch)."""
        schedule = AccumulationSchedule(schedule)
        if schedule.unit != "epoch":
            raise ValueError(f"the invariant sampler needs an epoch-keyed schedule; this one is keyed by "
                             f"{schedule.unit}")
        self.schedule = schedule

    def set_epoch(self, epoch: int) -> None:
        """The epoch to iterate next, from its first sample (a resume then calls :meth:`start_at_sample`)."""
        self.epoch, self.start = int(epoch), 0

    def start_at_sample(self, position: int) -> None:
        """Lay this epoch's windows out from sample ``position`` of its order (what was trained before is skipped)."""
        if not 0 <= position <= self.size:
            raise ValueError(f"position={position} must be in 0..{self.size}")
        self.start = int(position)

    def factor(self, epoch: int | None = None) -> int:
        return self.schedule.factor_at(self.epoch if epoch is None else epoch)

    def global_window(self, epoch: int | None = None) -> int:
        """Samples per full window: factor x world x micro-batch size."""
        return self.factor(epoch) * self.world * self.micro

    def windows(self, epoch: int | None = None, start: int | None = None) -> list[tuple[int, int]]:
        """The ``(first, end)`` positions of ``epoch``'s windows (default: the current epoch, from its start)."""
        if start is None:
            start = self.start if epoch is None or epoch == self.epoch else 0
        return window_bounds(self.size, self.global_window(epoch), start)

    def sample_offset(self, micro_batches: int) -> int:
        """The position in the current epoch's order after this rank's first ``micro_batches`` micro-batches (a
        window boundary: a multiple of the factor), e.g. ``engine.micro_in_epoch`` at a checkpoint."""
        factor = self.factor()
        if micro_batches % factor:
            raise ValueError(f"{micro_batches} micro-batches is inside a window of {factor}")
        return min(self.size, self.start + micro_batches // factor * self.global_window())

    def plan(self, epochs: int) -> list[tuple[int, int]]:
        """``(factor, windows)`` of each of ``epochs`` epochs from the first sample (for step totals and ETAs)."""
        return [(self.factor(e), len(window_bounds(self.size, self.global_window(e)))) for e in range(epochs)]

    def __len__(self) -> int:
        return len(self.windows()) * self.factor()

    def __iter__(self):
        order = epoch_order(self.size, self.epoch, self.seed, self.shuffle)
        factor = self.factor()
        for first, end in self.windows():
            for a, b in rank_micro_batches(first, end, self.world, self.rank, factor):
                yield order[a:b]


class EmptyMicroBatch:
    """A micro-batch with no sample of this rank's: ``filler`` (one collated sample) is run with zero weight."""

    __slots__ = ("filler",)

    def __init__(self, filler):
        self.filler = filler


class InvariantCollate:
    """The loader's ``collate_fn`` for :class:`InvariantBatchSampler`: ``collate_fn`` (default: torch's) on a
    micro-batch, an :class:`EmptyMicroBatch` holding the dataset's sample ``filler_index`` for an empty one."""

    def __init__(self, dataset, collate_fn: Callable | None = None, filler_index: int = 0):
        self.dataset, self.collate_fn, self.filler_index = dataset, collate_fn or default_collate, filler_index

    def __call__(self, samples: list):
        if samples:
            return self.collate_fn(samples)
        return EmptyMicroBatch(self.collate_fn([self.dataset[self.filler_index]]))


__all__ = ["EmptyMicroBatch", "InvariantBatchSampler", "InvariantCollate", "epoch_order", "rank_micro_batches",
           "split", "window_bounds"]
