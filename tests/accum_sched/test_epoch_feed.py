"""accum_sched/epoch_feed.py on its own, in one process: the sized feed and the stream feed hand out the same
micro-batches with the epoch's last one marked, skip what a resume trained, and count the stream's agreements."""
from __future__ import annotations

import pytest
import torch

from accum_sched.epoch_feed import SizedFeed, StreamFeed, batch_size


def _drain(feed) -> list:
    out = []
    while (item := feed.next()) is not None:
        out.append(item)
    feed.close()
    return out


def test_sized_feed_marks_the_last_and_skips_what_was_trained():
    assert _drain(SizedFeed(range(7), 7, 0, True, 7, 0)) == [(i, i == 6) for i in range(7)]
    assert _drain(SizedFeed(range(7), 5, 0, True, 7, 0)) == [(i, i == 4) for i in range(5)]  # truncated to 5
    assert _drain(SizedFeed(range(7), 7, 3, True, 7, 0)) == [(i, i == 6) for i in range(3, 7)]  # read and dropped
    assert _drain(SizedFeed(range(3, 7), 7, 3, False, 7, 0)) == [(i, i == 6) for i in range(3, 7)]  # positioned
    assert _drain(SizedFeed(range(7), 7, 7, True, 7, 0)) == []  # the epoch was complete


def test_sized_feed_says_when_the_loader_breaks_its_length():
    feed = SizedFeed(range(3), 5, 0, True, 5, 2)
    for _ in range(3):
        feed.next()
    with pytest.raises(RuntimeError, match="epoch 2: the loader ended after 3 micro-batches but len\\(\\) promised 5"):
        feed.next()


@pytest.mark.parametrize("read_ahead", [1, 2, 4])
def test_stream_feed_matches_the_sized_one_and_counts_its_agreements(read_ahead):
    counted = []
    feed = StreamFeed(iter(range(9)), 2, True, 0, uneven="truncate", read_ahead=read_ahead, count=counted.append)
    assert _drain(feed) == [(i, i == 8) for i in range(2, 9)]
    assert feed.ended and sum(counted) == 0  # one process: the flags need no all-reduce
    assert _drain(StreamFeed(iter(()), 0, True, 0, uneven="truncate", read_ahead=read_ahead, count=counted.append)) \
        == []


def test_batch_size_reads_the_leading_dimension():
    x = torch.zeros(5, 3)
    assert batch_size((x, torch.zeros(5))) == 5
    assert batch_size({"input_ids": torch.zeros(4, 9)}) == 4
    assert batch_size([[1, 2], [3, 4], [5, 6]]) == 2  # a list of lists: the first's length
    assert batch_size(torch.tensor(1.0)) == 1
