"""accum_sched/noise_tracking.py on its own, in one process: what it refuses (one line each), its saved state, and
that the adaptive controller it drives sees every finished window."""
from __future__ import annotations

import pytest
import torch

from accum_sched.adaptive import AdaptiveFactor
from accum_sched.backends.single import SingleProcessBackend
from accum_sched.noise_tracking import NoiseTracking


def _backend(precision="fp32"):
    model = torch.nn.Linear(3, 1)
    return SingleProcessBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"normalize": "micro_batches"}, "noise_scale needs normalize='elements'"),
    ({"precision": "fp16"}, "noise_scale is not measured under fp16"),
    ({"adaptive": {"min_factor": 1}}, "adaptive in one process needs min_factor >= 2"),
    ({"adaptive": {"min_factor": 2, "speed": 3}}, "adaptive: unknown keys speed"),
])
def test_refusals_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as info:
        NoiseTracking(_backend(), **kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_back_end_without_a_probe_is_refused():
    class NoProbe(SingleProcessBackend):
        name = "NoProbe"
        capabilities = SingleProcessBackend.capabilities.__class__(stop_mid_window=True, prescale=True,
                                                                  fp16="grad_scaler", noise_scale=None)

    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match="noise_scale / adaptive are not measured with NoProbe yet"):
        NoiseTracking(NoProbe(model, torch.optim.SGD(model.parameters(), lr=0.1)))


def test_state_round_trip_and_the_controller_sees_each_window():
    controller = AdaptiveFactor(min_factor=2, max_factor=8, every_n_steps=1)
    tracking = NoiseTracking(_backend(), controller)
    assert tracking.adaptive is controller and tracking.reason == "initial: min_factor 2"
    tracking.noise.estimator.update(4.0, 1.0, 2.0, 8.0)  # one window's estimates
    tracking.after_step(1, {"noise_scale": 64.0}, 16.0, 2)  # 8 elements per unit of factor: target 8
    assert controller.factor == 8 and controller.reason.startswith("step 1: 2 -> 8")
    state = tracking.state_dict()
    assert set(state) == {"noise_scale", "adaptive"}
    again = NoiseTracking(_backend(), AdaptiveFactor(min_factor=2, max_factor=8, every_n_steps=1))
    again.load_state_dict(state)
    assert again.state_dict() == state and again.adaptive.factor == 8
    plain = NoiseTracking(_backend())
    assert plain.reason is None and set(plain.state_dict()) == {"noise_scale"}
    plain.after_step(1, {"noise_scale": None}, 16.0, 2)  # no controller: nothing to decide
