"""Turn an LR schedule's decay into batch growth: ``smith`` and ``seesaw`` (issue 27.2). Standard library only.

The *reference* run trains at factor 1 with the configured LR schedule: its step s is micro-batch s of the run, and
its LR is ``base x m[s]``. The converted run reads the same micro-batches in windows whose factor grows where the
reference LR has decayed. With r(s) = (highest m up to s) / m[s] (how far the LR has fallen from its peak; 1 during
warm-up and before any decay), a window that starts at micro-batch s gets, within ``max_factor``:

* ``smith`` (Smith et al. 2017, "Don't decay the learning rate, increase the batch size"): factor = floor(r), and the
  LR ``base x m[s] x factor``: each decay by a whole number alpha becomes factor x alpha with the LR held; between
  whole numbers (a cosine) and beyond ``max_factor`` the LR decays as before, by what the batch did not absorb;
* ``seesaw`` (arXiv 2510.14717): k = number of halvings of the LR so far (floor(log2 r)), factor = 2 ** k, and the LR
  ``base x m[s] x sqrt(2) ** k``: each halving becomes factor x 2 and LR x 1/sqrt(2).

The factor changes only where the schedule's unit can express it: at a window start for ``step`` and ``samples``,
at an epoch start for ``epoch`` (quantised: the factor of the epoch's first micro-batch). The result is an ordinary
schedule plus one LR multiplier per optimizer step of the converted run, whose length is the exact step total.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from accum_sched.schedule import AccumulationSchedule

RULES = ("smith", "seesaw")
KEYS = ("rule", "max_factor")
UNITS = ("epoch", "step", "samples")
_EPS = 1e-9


@dataclass(frozen=True)
class Converted:
    schedule: AccumulationSchedule
    lr: tuple[float, ...]  # LR / base LR of each optimizer step of the converted run
    factors: tuple[int, ...]  # the factor of each optimizer step
    starts: tuple[int, ...]  # the micro-batch (of the run, counted over epochs) each step's window starts at

    @property
    def total_steps(self) -> int:
        return len(self.lr)


def validate(spec) -> dict:
    """``{rule, max_factor}`` with defaults (max_factor 8), or ValueError naming the key."""
    if not isinstance(spec, dict):
        raise ValueError(f"schedule_from must be a mapping such as {{rule: smith, max_factor: 8}}, got {spec!r}")
    unknown = [k for k in spec if k not in KEYS]
    if unknown:
        raise ValueError(f"schedule_from.{unknown[0]}: unknown key; the keys are {', '.join(KEYS)}")
    rule = spec.get("rule")
    if rule not in RULES:
        raise ValueError(f"schedule_from.rule={rule!r} is not one of {', '.join(RULES)}")
    cap = spec.get("max_factor", 8)
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise ValueError(f"schedule_from.max_factor={cap!r} must be an integer >= 1")
    return {"rule": rule, "max_factor": cap}


def wanted(rule: str, cap: int, ratio: float) -> tuple[int, float]:
    """(factor, LR multiplier on top of the reference's) for an LR fallen ``ratio`` x from its peak."""
    if rule == "smith":
        factor = max(1, min(cap, math.floor(ratio + _EPS)))
        return factor, float(factor)
    halvings = max(0, math.floor(math.log2(ratio) + _EPS)) if ratio > 0 else 0
    halvings = min(halvings, int(math.floor(math.log2(cap) + _EPS)))
    return 2 ** halvings, math.sqrt(2.0) ** halvings


def convert(spec: dict, multipliers: Sequence[float], batches_per_epoch: Sequence[int], unit: str = "epoch", *,
            samples_per_micro_step: Callable[[int, int], int] | None = None,
            max_steps: int | None = None) -> Converted:
    """The converted run for reference LR multipliers ``multipliers`` (one per micro-batch of the run).

    ``batches_per_epoch``: micro-batches per rank per epoch; ``samples_per_micro_step(epoch, index)``: global
    samples of a micro-step (needed for ``unit="samples"``); ``max_steps``: ``run.max_steps``.
    """
    spec = validate(spec)
    if unit not in UNITS:
        raise ValueError(f"schedule_from with unit {unit!r} is not supported (the factor is placed by micro-batch "
                         f"position); use unit epoch, step or samples")
    if len(multipliers) < sum(batches_per_epoch):
        raise ValueError(f"{len(multipliers)} reference LR multipliers for {sum(batches_per_epoch)} micro-batches")
    rule, cap = spec["rule"], spec["max_factor"]
    milestones: dict[int, int] = {}
    lrs, factors, starts = [], [], []
    peak, current, step, samples, s = 0.0, 1, 0, 0, 0
    for epoch, batches in enumerate(batches_per_epoch):
        i = 0
        while i < batches:
            m = multipliers[s]
            peak = max(peak, m)
            factor, _ = wanted(rule, cap, peak / m if m > 0 else math.inf)
            counter = {"epoch": epoch, "step": step, "samples": samples}[unit]
            if factor != current and (unit != "epoch" or i == 0):
                milestones[counter] = current = factor
            size = min(current, batches - i)
            # smith: the LR x the factor (held through whole decays); seesaw: x sqrt(2) per doubling = sqrt(factor)
            lrs.append(m * (current if rule == "smith" else math.sqrt(current)))
            factors.append(current)
            starts.append(s)
            if samples_per_micro_step is not None:
                samples += sum(samples_per_micro_step(epoch, j) for j in range(i, i + size))
            # the running peak covers every micro-batch read, not only window starts
            peak = max(peak, *multipliers[s:s + size])
            i, s, step = i + size, s + size, step + 1
            if max_steps is not None and step >= max_steps:
                return _result(milestones, unit, lrs, factors, starts)
    return _result(milestones, unit, lrs, factors, starts)


def _result(milestones, unit, lrs, factors, starts) -> Converted:
    schedule = AccumulationSchedule(milestones or {0: 1}, unit)
    return Converted(schedule, tuple(lrs), tuple(factors), tuple(starts))


def ranges(converted: Converted) -> list[tuple[int, int, int, float, float]]:
    """``[(first step, last step, factor, LR multiplier at first, at last), ...]`` (1-based steps) for display."""
    out = []
    for j, (factor, lr) in enumerate(zip(converted.factors, converted.lr), 1):
        if out and out[-1][2] == factor:
            first, _, _, lr0, _ = out[-1]
            out[-1] = (first, j, factor, lr0, lr)
        else:
            out.append((j, j, factor, lr, lr))
    return out
