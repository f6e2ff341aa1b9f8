"""accum_sched/optimizer_rules.py on its own: the LR multiplier of each coupling rule against its formula, co-scaling's
beta2 and weight decay, and the refusals, one line each. In-process, no engine."""
from __future__ import annotations

import math

import pytest
import torch

from accum_sched.co_scale import GroupScale
from accum_sched.optimizer_rules import OptimizerRules


def _groups(optimizer: str = "sgd"):
    params = [torch.nn.Parameter(torch.zeros(2))]
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=0.1, betas=(0.9, 0.99), weight_decay=0.1).param_groups
    return torch.optim.SGD(params, lr=0.1).param_groups


def test_linear_and_sqrt_follow_the_factor_relative_to_the_first():
    linear = OptimizerRules("linear", None, _groups(), "SGD", first_factor=2)
    sqrt = OptimizerRules("sqrt", None, _groups(), "SGD", first_factor=2)
    none = OptimizerRules("none", None, _groups(), "SGD", first_factor=2)
    for factor in (1, 2, 3, 8):
        assert linear.lr_scale(factor) == factor / 2
        assert sqrt.lr_scale(factor) == (factor / 2) ** 0.5
        assert none.lr_scale(factor) == 1.0
        assert linear.step_scale(factor, linear.lr_scale(factor)) == factor / 2  # LR only: a plain float


def test_adascale_gain_is_between_one_and_the_batch_ratio():
    rules = OptimizerRules("adascale", None, _groups(), "SGD", first_factor=1)
    assert rules.lr_scale(4, None, 4, 64.0) == 1.0  # no estimate yet
    assert rules.lr_scale(4, -3.0, 4, 64.0) == 1.0  # a meaningless one
    for noise in (1.0, 40.0, 1e6):
        gain = rules.lr_scale(4, noise, 4, 64.0)  # B = 64 elements in 4 micro-batches; B0 = 16
        assert gain == pytest.approx((noise / 16 + 1) / (noise / 64 + 1), rel=1e-15)
        assert 1.0 <= gain <= 4.0
    assert rules.lr_scale(4, 1e12, 4, 64.0) == pytest.approx(4.0, rel=1e-9)  # all noise: the linear rule


def test_co_scale_moves_beta2_and_weight_decay_with_the_batch():
    groups = _groups("adamw")
    rules = OptimizerRules("none", {"lr": "auto", "beta2": "half_life", "weight_decay": "tau"}, groups, "AdamW", 1)
    assert rules.rules == {"lr": "sqrt", "beta2": "half_life", "weight_decay": "tau"}  # auto: Adam-family
    lr = rules.lr_scale(4)
    assert lr == 2.0
    scale = rules.step_scale(4, lr)
    assert scale == GroupScale(lr=2.0, beta2_power=4.0, weight_decay=2.0)  # r / (eta / eta0) = 4 / 2
    beta2, wd = rules.reported(groups, scale)
    assert beta2 == pytest.approx(0.99 ** 4) and wd == pytest.approx(0.2)
    assert rules.step_scale(1, rules.lr_scale(1)) == 1.0  # the first factor changes nothing
    assert math.isclose(rules.reported(groups, 1.0)[0], 0.99)


@pytest.mark.parametrize(("coupling", "co_scale", "optimizer", "message"), [
    ("cubic", None, "sgd", "lr_coupling='cubic' is not one of none, linear, sqrt, adascale"),
    ("linear", {"lr": "sqrt"}, "sgd", "lr_coupling='linear' and co_scale lr='sqrt' disagree: give one"),
    ("none", {"beta2": "half_life"}, "sgd", "co_scale.beta2=half_life: SGD has no betas"),
    ("none", {"lr": "fast"}, "sgd", "co_scale.lr='fast' is not one of none, linear, sqrt, auto"),
])
def test_refusals_are_one_line(coupling, co_scale, optimizer, message):
    with pytest.raises(ValueError) as info:
        OptimizerRules(coupling, co_scale, _groups(optimizer), "SGD", 1)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
