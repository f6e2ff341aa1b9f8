"""Exact optimizer-step totals for schedules keyed by steps, samples or tokens, by simulating the windows.

An epoch-keyed schedule has a closed form (sum of ceil(batches / factor)). For the other units the factor of each
window depends on counters the previous windows advanced, so the windows are replayed exactly as the engine forms
them: a window starts at each epoch start or where the previous one ended, takes the factor at the counters
completed before it, and ends at the epoch end at the latest. Standard library only.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from accum_sched.position import Position, per_epoch

PerMicroStep = int | Callable[[int, int], int] | None


def _per_step(value: PerMicroStep, what: str) -> Callable[[int, int], int]:
    if value is None:
        raise ValueError(f"a {what}-keyed schedule needs the global {what} of each micro-step to count its steps; "
                         f"pass {what}_per_micro_step (an int, or a function (epoch, index) -> int)")
    if callable(value):
        return value
    return lambda epoch, index: value


def simulate_windows(schedule, batches_per_epoch: int | Sequence[int], epochs: int,
                     samples_per_micro_step: PerMicroStep = None, tokens_per_micro_step: PerMicroStep = None):
    """Yield ``(epoch, factor, micro_batches)`` for every window the engine would form."""
    epochs_batches = per_epoch(batches_per_epoch, epochs)
    samples_of = tokens_of = None
    if schedule.unit == "samples":
        samples_of = _per_step(samples_per_micro_step, "samples")
    if schedule.unit == "tokens":
        tokens_of = _per_step(tokens_per_micro_step, "tokens")
    steps = samples = tokens = 0
    for epoch, batches in enumerate(epochs_batches):
        index = 0
        while index < batches:
            factor = schedule.factor_for(Position(epoch=epoch, step=steps, samples=samples, tokens=tokens))
            size = min(factor, batches - index)
            if samples_of is not None:
                samples += sum(samples_of(epoch, i) for i in range(index, index + size))
            if tokens_of is not None:
                tokens += sum(tokens_of(epoch, i) for i in range(index, index + size))
            index += size
            steps += 1
            yield epoch, factor, size


def simulate_steps(schedule, batches_per_epoch, epochs: int, samples_per_micro_step: PerMicroStep = None,
                   tokens_per_micro_step: PerMicroStep = None) -> int:
    """The exact number of optimizer steps (see :func:`simulate_windows`)."""
    return sum(1 for _ in simulate_windows(schedule, batches_per_epoch, epochs, samples_per_micro_step,
                                           tokens_per_micro_step))
