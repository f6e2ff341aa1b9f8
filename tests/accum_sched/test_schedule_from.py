"""accum_sched.schedule_from on explicit numbers: where the factor changes in each unit, the cap, run.max_steps."""
from __future__ import annotations

import math

import pytest

from accum_sched.schedule_from import convert

STEP = [1.0] * 8 + [0.5] * 8 + [0.25] * 8 + [0.125] * 8  # halvings at micro-batches 8, 16, 24 (4 epochs of 8)


def test_samples_unit_places_the_change_at_the_samples_read():
    c = convert({"rule": "smith"}, STEP, [8, 8, 8, 8], "samples", samples_per_micro_step=lambda e, i: 20)
    # 8 micro-batches x 20 samples before the first halving; 8 more (4 windows of 2) before the second ...
    assert c.schedule.to_dict() == {160: 2, 320: 4, 480: 8}
    assert c.factors == (1,) * 8 + (2,) * 4 + (4,) * 2 + (8,)
    assert c.lr == (1.0,) * 15  # every decay absorbed by the batch


def test_seesaw_caps_at_max_factor_and_decays_the_rest():
    c = convert({"rule": "seesaw", "max_factor": 2}, STEP, [8, 8, 8, 8], "step")
    assert c.schedule.to_dict() == {8: 2}
    # after the cap: factor 2, LR = reference x sqrt(2): 0.5 -> 0.707, 0.25 -> 0.354, 0.125 -> 0.177
    assert c.factors == (1,) * 8 + (2,) * 12
    assert c.lr == pytest.approx((1.0,) * 8 + tuple(m * math.sqrt(2) for m in (0.5,) * 4 + (0.25,) * 4
                                                    + (0.125,) * 4))


def test_epoch_unit_quantises_and_max_steps_cuts():
    # the halvings fall mid-epoch (micro-batch 12 of epochs of 8): the factor follows at the next epoch start
    m = [1.0] * 12 + [0.5] * 20
    c = convert({"rule": "smith"}, m, [8, 8, 8, 8], "epoch", max_steps=20)
    assert c.schedule.to_dict() == {2: 2}
    assert c.factors == (1,) * 16 + (2,) * 4 and c.total_steps == 20  # cut at run.max_steps
    # the LR decays inside epoch 1 until the factor can move, then the batch takes the decay over
    assert c.lr == (1.0,) * 12 + (0.5,) * 4 + (1.0,) * 4


def test_warm_up_does_not_grow_the_batch():
    warm = [0.25, 0.5, 0.75] + [1.0] * 5 + [0.5] * 8
    c = convert({"rule": "smith"}, warm, [8, 8], "step")
    assert c.factors[:8] == (1,) * 8 and c.factors[8:] == (2,) * 4
