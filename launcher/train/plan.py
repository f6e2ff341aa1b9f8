"""Element (token) counts for planning a token-keyed run's optimizer-step total, reading the dataset once.

The total depends on the elements of every micro-step of every epoch on every rank. Collating every shard of every
epoch to count them loads the dataset epochs x world times before the first step; instead each sample is counted
once (the task's ``length_fn(sample)``, else ``count_fn`` of a one-sample batch, which must then be additive over
samples, as a count of real tokens is), the ranks splitting the pass between them, and each micro-step's count is
a sum over the indices DistributedSampler deals it, computed from the index lists alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, default_collate

from accum_sched import collective


def sample_counts(task, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Elements of every sample (int64, one per dataset index). Rank r loads samples r, r + world, ...; one
    all-reduce of 8 bytes per sample (on a gloo group) gives every rank all of them. Collective when world > 1."""
    dataset = task.dataset
    counts = torch.zeros(len(dataset), dtype=torch.int64)
    collate = task.collate_fn or default_collate
    for i in range(rank, len(dataset), world):
        sample = dataset[i]
        counts[i] = int(task.length_fn(sample)) if task.length_fn is not None else int(task.count_fn(collate([sample])))
    if world > 1 and collective.is_distributed():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=collective.side_group())
    return counts


def micro_step_counts(counts: torch.Tensor, dataset, epochs: int, world: int, micro: int, batches: int,
                      shuffle: bool, seed: int) -> dict[int, list[int]]:
    """``{epoch: [elements of micro-step i over all ranks]}`` from the samples' counts and the shards' indices."""
    out = {}
    for epoch in range(epochs):
        per_step = torch.zeros(batches, dtype=torch.int64)
        for rank in range(world):
            shard = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                       drop_last=False)
            shard.set_epoch(epoch)
            mine = counts[torch.tensor(list(shard), dtype=torch.int64)][: batches * micro]
            padded = torch.zeros(batches * micro, dtype=torch.int64)
            padded[: len(mine)] = mine
            per_step += padded.view(batches, micro).sum(1)
        out[epoch] = per_step.tolist()
    return out
