"""accum_sched/open_window.py on its own: the window's loss sum and counts, its saved form, and a window saved by an
earlier development version refused in one line. In-process."""
from __future__ import annotations

import pytest
import torch

from accum_sched.open_window import KEYS, OpenWindow


def test_losses_are_summed_once_in_float64_and_the_window_closes():
    window = OpenWindow()
    assert not window.is_open
    one = torch.tensor(1.5, dtype=torch.float32, requires_grad=True)
    window.add(one * 2, 3)
    assert window.is_open and window.elements == 3
    assert window.loss_sum() is window.losses[0]  # one micro-batch: the loss itself, no tensor operation
    window.add(torch.tensor([0.25]), torch.tensor(2))  # a (1,)-shaped loss and a tensor count
    total = window.loss_sum()
    assert total.dtype == torch.float64 and total.item() == 3.25 and int(window.elements) == 5
    window.close()
    assert not window.is_open and window.losses == [] and window.samples == 0


def test_saved_window_comes_back_with_its_carried_loss():
    window = OpenWindow()
    window.add(torch.tensor(2.0), 4)
    window.samples, window.start = 4, 6
    state = window.state_dict(0.125, ["grads"])
    assert set(state) == set(KEYS)
    assert state == {"start_micro_batch": 6, "loss_sum": 2.0, "elements": 4.0, "samples": 4, "loss_multiplier": 0.125,
                     "local_grads": ["grads"]}
    resumed = OpenWindow()
    assert resumed.load_state_dict(state) == ["grads"]
    assert (resumed.start, resumed.samples, resumed.saved_multiplier) == (6, 4, 0.125)
    resumed.add(torch.tensor(1.0), 2)
    assert resumed.loss_sum().item() == 3.0 and float(resumed.elements) == 6.0
    assert OpenWindow().load_state_dict(None) is None


def test_a_window_of_an_earlier_development_version_is_one_line():
    old = {"start": 6, "loss": 2.0, "elements": 4.0, "samples": 4, "grads": []}  # no loss multiplier, old names
    with pytest.raises(ValueError) as info:
        OpenWindow().load_state_dict(old)
    message = str(info.value)
    assert "written by an earlier development version" in message and "\n" not in message
    assert message.startswith("the saved open window lacks start_micro_batch, loss_sum, loss_multiplier, local_grads")
