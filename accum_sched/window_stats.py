"""The numbers ranks sum at each window end (element and sample counts, loss, flags), packed into one small vector.

The vector travels inside a gradient bucket when it can (DDP: see :mod:`accum_sched.backends.ddp_hook`), so it is
summed in the bucket's dtype, usually fp32. fp32 holds integers exactly only up to 2**24, so each count is split into
three base-4096 digits: a digit is < 4096 on every rank, the sum of one digit over up to 4096 ranks stays < 2**24, and
the sums are exact in any summation order. Counts up to 2**36 per rank and window are exact.

Building the vector never waits for the device: host numbers go up through one pinned, non-blocking copy (CUDA) and
device numbers (a loss, an element count that is a tensor) are used where they are.
"""
from __future__ import annotations

import array
import dataclasses
import math
from dataclasses import dataclass

import torch

DIGIT = 4096
# elements (3 digits), samples (3 digits), stop flag, stream-short flag (a rank lacks some of the micro-batches a
# stream read ahead at this boundary: accum_sched.streams), the rank's mean micro-batch time in microseconds (2
# digits, capped at 16.7 s: accum_sched.stop_poll's time floor; 0 when not measured), loss sum (NaN or infinite when
# a rank's was)
SIZE = 11
MICRO_US_MAX = DIGIT ** 2 - 1


def _time_digits(micro_us: int) -> list[float]:
    micro_us = min(int(micro_us), MICRO_US_MAX)
    return [float(micro_us // DIGIT), float(micro_us % DIGIT)]


def _digits(value: int) -> list[float]:
    value = int(value)
    if not 0 <= value < DIGIT ** 3:
        raise ValueError(f"a window count of {value} is out of range (0 .. {DIGIT ** 3 - 1})")
    return [float(value // DIGIT ** 2), float(value // DIGIT % DIGIT), float(value % DIGIT)]


def _tensor_digits(value: torch.Tensor) -> torch.Tensor:
    n = value.detach().reshape(()).round().to(torch.int64)
    return torch.stack([n // DIGIT ** 2, n // DIGIT % DIGIT, n % DIGIT])


def _host_vector(values: list[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    # pinned + non_blocking: the copy is queued, the host does not wait (a pageable copy would block)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def encode(elements, samples: int, loss: torch.Tensor, stop: bool, dtype: torch.dtype,
           device: torch.device | None = None, short: bool = False, micro_us: int = 0) -> torch.Tensor:
    """The local vector of one window, on ``device`` (default: ``loss``'s), in ``dtype``.

    ``elements`` is an int or an integer-valued tensor (the sum of the loss functions' element counts), ``loss`` the
    sum of the window's losses on this rank (float64, or the loss itself for a window of one micro-batch). Two
    tensor operations in the usual case (int counts): the host numbers in one tensor, the loss copied into its last
    place (converted to ``dtype`` on the way).
    """
    device = loss.device if device is None else device
    host = _digits(samples) + [float(stop), float(short)] + _time_digits(micro_us) + [0.0]
    if isinstance(elements, torch.Tensor):
        out = torch.cat([_tensor_digits(elements).to(device, dtype), _host_vector(host, device, dtype)])
    else:
        out = _host_vector(_digits(elements) + host, device, dtype)
    out[SIZE - 1] = loss.detach() if loss.dim() == 0 else loss.detach().reshape(())  # a NaN or inf stays one
    return out


_TYPECODES = {torch.float32: "f", torch.float64: "d"}


class HostEncoder:
    """:func:`encode` into one CPU vector kept across windows, for the usual case (int counts, CPU, fp32/fp64).

    The vector lives in a Python ``array`` that a tensor shares (``torch.frombuffer``), so the ten host numbers
    are written without building a tensor, and the loss is copied into a view of the last place made once: about
    16 us of CPU per window instead of ~40 us for a tensor built from a list and an indexed write (development
    machine, under load). Every back end has read the vector (summed it, or copied it into a bucket) by the end of
    the window's step, before the next window writes it. Anything else goes to :func:`encode`.
    """

    def __init__(self):
        self._dtype = None

    def __call__(self, elements, samples: int, loss: torch.Tensor, stop: bool, dtype: torch.dtype,
                 device: torch.device, short: bool = False, micro_us: int = 0) -> torch.Tensor:
        code = _TYPECODES.get(dtype)
        if device.type != "cpu" or code is None or isinstance(elements, torch.Tensor):
            return encode(elements, samples, loss, stop, dtype, device, short, micro_us)
        if dtype != self._dtype:
            self._host = array.array(code, bytes(SIZE * torch.empty((), dtype=dtype).element_size()))
            self._out = torch.frombuffer(self._host, dtype=dtype)
            self._loss_slot = self._out[SIZE - 1]
            self._dtype = dtype
        flags = [float(stop), float(short)] + _time_digits(micro_us)
        self._host[:SIZE - 1] = array.array(code, _digits(elements) + _digits(samples) + flags)
        self._loss_slot.copy_(loss.detach() if loss.dim() == 0 else loss.detach().reshape(()))
        return self._out


@dataclass(frozen=True)
class WindowTotals:
    """A window's numbers summed over ranks (read on the host once per optimizer step)."""

    elements: int
    samples: int
    stop: bool
    stream_short: bool  # some rank lacks a micro-batch its stream read ahead at this boundary (accum_sched.streams)
    micro_us: float  # sum over ranks of their mean micro-batch time in microseconds (0: not measured)
    loss: float  # sum over ranks of the window's losses
    nonfinite: bool  # a rank's loss was NaN or infinite (a sum with one NaN or inf in it is NaN or inf); the
    # gradient's own check is its norm, where it is measured
    grad_norm: float | None  # global norm of the accumulated gradient before normalisation, if it was taken
    found_inf: bool = False  # fp16 (a torch GradScaler): its unscale found an inf/NaN in the reduced gradient
    loss_scale: float | None = None  # fp16 (a torch GradScaler): the scale this window was scaled with


def decode(values: list[float]) -> WindowTotals:
    """Read :func:`encode`'s layout summed over ranks, plus an optional squared gradient norm appended after it."""
    d = [round(v) for v in values[:6]]  # the digits of the two counts (round() of a float is an int)
    squared = values[SIZE] if len(values) > SIZE else None
    loss = values[SIZE - 1]
    return WindowTotals(elements=(d[0] * DIGIT + d[1]) * DIGIT + d[2], samples=(d[3] * DIGIT + d[4]) * DIGIT + d[5],
                        stop=values[6] > 0, stream_short=values[7] > 0,
                        micro_us=round(values[8]) * DIGIT + round(values[9]), loss=loss,
                        nonfinite=loss != loss or abs(loss) == float("inf"),
                        grad_norm=None if squared is None else squared ** 0.5)


def read(backend, want_norm: bool) -> WindowTotals:
    """The window's numbers summed over ranks, its gradient norm if ``want_norm`` and, under a torch GradScaler, the
    scaler's verdict (found inf, scale), from ``backend``'s :meth:`~accum_sched.backends.Backend.window_totals` and
    :meth:`~accum_sched.backends.Backend.scaler_verdict`: the one host transfer of an optimizer step."""
    stats, squared_norm = backend.window_totals(want_norm)
    scaler = backend.scaler_verdict()
    values = stats if stats.dim() == 1 else stats.reshape(-1)
    tail = [t.reshape(-1) for t in (squared_norm, scaler) if t is not None]
    if tail:  # float64 holds the fp32 counts, the scale (a power of two) and the found-inf sum exactly
        values = torch.cat([values.to(torch.float64)] + [t.to(values.device, torch.float64) for t in tail])
    host = values.tolist()  # the host sync of this optimizer step
    if scaler is None:
        return decode(host)
    totals = decode(host[:-2])
    return dataclasses.replace(totals, found_inf=host[-2] != 0, loss_scale=host[-1])


def verdict(totals: WindowTotals, backend, nonfinite: str, epoch: int, step: int) -> tuple[bool, bool, float | None]:
    """(skip the step, an fp16 overflow, this window's loss scale); raises FloatingPointError under
    ``nonfinite='raise'`` for a non-finite loss or gradient that is not an fp16 overflow.

    Every rank holds the same summed numbers and the same reduced gradient, so every rank reaches the same verdict
    without another collective. fp16: a non-finite gradient is how dynamic loss scaling works, not an error: skip,
    back the scale off, never raise.
    """
    bad = totals.nonfinite or totals.found_inf or (
        totals.grad_norm is not None and not math.isfinite(totals.grad_norm))
    # the GradScaler's scale before update(), read with the window's numbers; a back end's own fp16 scaling
    # (DeepSpeed) counts alike
    loss_scale = totals.loss_scale if totals.loss_scale is not None else backend.native_loss_scale()
    overflow = bad and loss_scale is not None
    if bad and nonfinite == "raise" and not overflow:
        raise FloatingPointError(f"non-finite loss or gradient at epoch {epoch}, step {step} (nonfinite='raise'; "
                                 f"use nonfinite='skip' to skip such steps)")
    return bad or totals.elements == 0, overflow, loss_scale
