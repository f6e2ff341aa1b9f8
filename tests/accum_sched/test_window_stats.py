"""accum_sched/window_stats.py's layout on its own: what two ranks encode, summed in fp32 as a gradient bucket sums
it, decodes to the exact sums (counts, flags, the stop poll's micro-batch times), whichever encoder wrote it."""
from __future__ import annotations

import torch

from accum_sched import window_stats


def test_two_ranks_numbers_summed_in_fp32_decode_to_the_exact_sums():
    ranks = [  # elements, samples, stop, short, micro-batch time (us), loss
        (70_000_123, 4_100_000, False, True, 3_000_001, 2.5),
        (123, 9, True, False, 16_777_215, -0.5),
    ]
    for encoder in (window_stats.encode, window_stats.HostEncoder()):
        vectors = [encoder(e, s, torch.tensor(loss), stop, torch.float32, torch.device("cpu"), short, us).clone()
                   for e, s, stop, short, us, loss in ranks]
        assert all(v.numel() == window_stats.SIZE for v in vectors)
        totals = window_stats.decode((vectors[0] + vectors[1]).tolist())
        assert (totals.elements, totals.samples) == (70_000_246, 4_100_009), encoder
        assert totals.stop and totals.stream_short and not totals.nonfinite, encoder
        assert totals.micro_us == 3_000_001 + 16_777_215, encoder
        assert totals.loss == 2.0, encoder


def test_a_micro_batch_time_past_the_layouts_range_is_capped_and_0_means_not_measured():
    capped = window_stats.encode(1, 1, torch.tensor(0.0), False, torch.float32, micro_us=10 ** 9)
    assert window_stats.decode(capped.tolist()).micro_us == window_stats.MICRO_US_MAX
    unmeasured = window_stats.encode(1, 1, torch.tensor(0.0), False, torch.float32)
    assert window_stats.decode(unmeasured.tolist()).micro_us == 0
