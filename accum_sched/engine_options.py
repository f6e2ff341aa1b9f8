"""The checks of :class:`accum_sched.AccumulationEngine`'s keyword arguments: one ValueError line naming the
argument, the value given and what it takes, before anything is built."""
from __future__ import annotations

from accum_sched.optimizer_rules import LR_COUPLING

NORMALIZE = ("elements", "micro_batches")
UNEVEN = ("truncate", "error")
NONFINITE = ("skip", "raise")
STOP_AT = ("boundary", "micro_batch")


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def check(*, normalize, uneven, nonfinite, lr_coupling, stop_at, norm_every, max_grad_norm, read_ahead,
          stop_poll_every, stop_poll_min_ms, schedule_given: bool, adaptive, noise_scale: bool) -> None:
    for name, value, allowed in (("normalize", normalize, NORMALIZE), ("uneven", uneven, UNEVEN),
                                 ("nonfinite", nonfinite, NONFINITE), ("lr_coupling", lr_coupling, LR_COUPLING),
                                 ("stop_at", stop_at, STOP_AT)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    if norm_every is not None and not (isinstance(norm_every, int) and norm_every >= 1):
        raise ValueError(f"norm_every={norm_every!r} must be an int >= 1, or None to measure only when clipping")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0, or None for no clipping")
    if not _positive_int(read_ahead):
        raise ValueError(f"read_ahead={read_ahead!r} must be an int >= 1")
    if not _positive_int(stop_poll_every):
        raise ValueError(f"stop_poll_every={stop_poll_every!r} must be an int >= 1 (micro-batches per stop poll)")
    if isinstance(stop_poll_min_ms, bool) or not isinstance(stop_poll_min_ms, (int, float)) or not (
            0 <= stop_poll_min_ms < float("inf")):
        raise ValueError(f"stop_poll_min_ms={stop_poll_min_ms!r} must be a number >= 0 (milliseconds between stop "
                         f"polls at least; 0: no floor)")
    if adaptive is not None and schedule_given:
        raise ValueError("give either a schedule or adaptive=, not both")
    if lr_coupling == "adascale" and not (noise_scale or adaptive is not None):
        raise ValueError("lr_coupling='adascale' needs the noise scale: set noise_scale=True (or adaptive=)")
