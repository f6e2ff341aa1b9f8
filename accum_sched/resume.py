"""Resume without loading what was trained: a sampler that starts at an offset into another sampler's indices.

The engine knows how many micro-batches of an epoch are trained (``engine.resume_offset(epoch)``). A DataLoader over
:class:`ResumeSampler` starts there: only indices are skipped (DistributedSampler's list for the epoch is a
permutation, cheap to make), no sample before the resume point is loaded, with ``num_workers`` 0 or more (the
DataLoader's main process iterates the sampler and hands indices to its workers). Then tell the engine the loader
is positioned::

    sampler = DistributedSampler(dataset, ...)
    resumable = ResumeSampler(sampler)
    loader = DataLoader(dataset, batch_size=micro, sampler=resumable)
    for epoch in range(engine.epoch_index, epochs):
        sampler.set_epoch(epoch)
        resumable.start_at(engine.resume_offset(epoch) * micro)
        for batch in engine.micro_batches(loader, epoch, skip=False):
            ...

What comes out is what the uninterrupted run loaded from that point, sample for sample. A dataset that draws
random numbers (augmentation) gets the same draws only where they come from the main process's generators and the
RNG state is put back (the launcher does that, num_workers=0); DataLoader workers are seeded per iterator and see
other samples before the resume point, so their draws differ (same distribution, other values).
"""
from __future__ import annotations

import itertools

from torch.utils.data import Sampler


class ResumeSampler(Sampler):
    """Yields ``sampler``'s indices from the ``start``-th on (``start_at``); ``len()`` counts only those."""

    def __init__(self, sampler, start: int = 0):
        self.sampler = sampler
        self.start = start

    def start_at(self, start: int) -> None:
        """Skip the first ``start`` indices (samples, not batches) of the next iteration; 0 for a whole epoch."""
        if start < 0:
            raise ValueError(f"start={start} must be >= 0")
        self.start = start

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.start)
