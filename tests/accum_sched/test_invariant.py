"""The invariant sampler's index arithmetic, in-process: every window is a contiguous slice of the epoch order, cut
over the ranks and into ``factor`` micro-batches, with nothing padded, duplicated or lost, whatever the world size."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from accum_sched import AccumulationSchedule
from accum_sched.invariant import (
    EmptyMicroBatch,
    InvariantBatchSampler,
    InvariantCollate,
    epoch_order,
    split,
)


def _rank_batches(size, world, micro, schedule, epoch, shuffle=True, seed=3):
    out = []
    for rank in range(world):
        sampler = InvariantBatchSampler(size, world, rank, micro, schedule, shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        out.append(batches)
    return out


@pytest.mark.parametrize("size", [1, 5, 29, 48, 50])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_windows_are_the_world_free_slices_of_the_epoch_order(size, world):
    global_window, micro = 12, 2
    factor = global_window // (world * micro)
    order = epoch_order(size, 1, seed=3, shuffle=True)
    per_rank = _rank_batches(size, world, micro, factor, epoch=1)
    # every rank has the same number of micro-batches, a multiple of the factor
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) % factor == 0
    windows = len(per_rank[0]) // factor
    assert windows == -(-size // global_window)
    for k in range(windows):
        # the window's samples, rank by rank, micro-batch by micro-batch: the k-th slice of the order, in order
        got = [i for rank in per_rank for batch in rank[k * factor:(k + 1) * factor] for i in batch]
        assert got == order[k * global_window:(k + 1) * global_window]
        for rank in per_rank:
            assert all(len(batch) <= micro for batch in rank[k * factor:(k + 1) * factor])


def test_the_order_is_distributed_samplers_permutation():
    data = list(range(29))
    reference = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    reference.set_epoch(2)
    assert epoch_order(29, 2, seed=5, shuffle=True) == list(reference)
    assert epoch_order(7, 2, seed=5, shuffle=False) == list(range(7))


def test_uneven_pieces_differ_by_at_most_one_and_larger_first():
    assert split(5, 3) == [2, 2, 1]
    assert split(1, 3) == [1, 0, 0]
    assert split(0, 2) == [0, 0]
    # window of 5 over 3 ranks at factor 2: rank 2 has one sample and one empty micro-batch
    per_rank = _rank_batches(5, 3, 2, 2, epoch=0, shuffle=False)
    assert per_rank == [[[0], [1]], [[2], [3]], [[4], []]]


def test_schedule_changes_the_window_per_epoch_and_len_follows():
    sampler = InvariantBatchSampler(29, 2, 0, 2, {0: 3, 1: 6}, shuffle=False)
    assert sampler.plan(2) == [(3, 3), (6, 2)]  # windows of 12 then 24 samples over 29
    sampler.set_epoch(1)
    assert len(sampler) == 12 and sampler.global_window() == 24


def test_start_at_sample_continues_the_epoch_from_a_window_boundary():
    whole = _rank_batches(29, 2, 2, 3, epoch=0)
    for rank in range(2):
        sampler = InvariantBatchSampler(29, 2, rank, 2, 3, seed=3)
        sampler.set_epoch(0)
        assert sampler.sample_offset(3) == 12 and sampler.sample_offset(9) == 29
        with pytest.raises(ValueError, match="inside a window"):
            sampler.sample_offset(4)
        sampler.start_at_sample(12)
        assert list(sampler) == whole[rank][3:]
        assert sampler.sample_offset(3) == 24  # counted from where this epoch started
        sampler.set_epoch(1)
        assert sampler.start == 0


def test_one_rank_resumes_where_two_stopped():
    # two ranks at factor 3 trained one window (12 samples); one rank at factor 6 continues with the same samples
    order = epoch_order(29, 0, seed=3, shuffle=True)
    single = InvariantBatchSampler(29, 1, 0, 2, 6, seed=3)
    single.set_epoch(0)
    single.start_at_sample(12)
    assert [i for b in single for i in b] == order[12:]


def test_empty_micro_batch_collates_to_a_filler():
    data = TensorDataset(torch.arange(10.0).reshape(5, 2), torch.arange(5.0))
    sampler = InvariantBatchSampler(5, 3, 2, 2, 2, shuffle=False)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=InvariantCollate(data))
    first, second = list(loader)
    assert first[0].tolist() == [[8.0, 9.0]]
    assert isinstance(second, EmptyMicroBatch) and second.filler[0].shape == (1, 2)


def test_refuses_a_schedule_not_keyed_by_epoch():
    with pytest.raises(ValueError, match="epoch-keyed"):
        InvariantBatchSampler(10, 1, 0, 2, AccumulationSchedule({0: 1, 5: 2}, unit="step"))
