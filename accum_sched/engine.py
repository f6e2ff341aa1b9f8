"""AccumulationEngine: scheduled gradient accumulation that is exact and keeps ranks in lockstep.

Use from any loop::

    engine = AccumulationEngine(ddp_model, optimizer, {0: 1, 5: 2, 10: 4}, lr_scheduler=sched)
    for epoch in range(engine.epoch_index, epochs):
        sampler.set_epoch(epoch)
        for batch in engine.micro_batches(loader, epoch):
            with engine.autocast():
                loss_sum, n = loss_fn(ddp_model, batch)   # sum of element losses, number of elements
            engine.backward(loss_sum, n)

Rules: windows start at each epoch start; the last window of an epoch may be partial and is stepped at the epoch
end, never carried over. The optimizer sees the gradient of the mean loss over every element of the window on every
rank, i.e. exactly one large batch. All ranks agree by collective on the factor, the schedule and the number of
micro-batches at every epoch start. At every window end they sum counts, loss and the non-finite and stop flags;
under DDP those numbers ride inside the gradient all-reduce (no collective of their own), and the host reads them,
with the gradient norm, in one transfer: the only host sync per optimizer step, none per micro-batch. With
``stop_at="micro_batch"`` a one-number stop flag is also summed per micro-batch, asynchronously on a gloo group of
its own, so a preemption is answered within about a micro-batch (see :class:`StopPoll`).

Resuming: ``load_state_dict`` then, per epoch, a loader positioned at ``resume_offset(epoch)`` with
``micro_batches(..., skip=False)`` (see accum_sched/resume.py), or the whole epoch with the default ``skip=True``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields

import torch

from accum_sched import co_scale, collective, streams, window_stats
from accum_sched.backends import make_backend
from accum_sched.backends.base import module_device
from accum_sched.schedule import AccumulationSchedule, Position
from accum_sched.step_rules import scale_gradients

log = logging.getLogger("accum_sched")

NORMALIZE = ("elements", "micro_batches")
UNEVEN = ("truncate", "error")
NONFINITE = ("skip", "raise")
PRECISION = ("fp32", "bf16", "fp16")
LR_COUPLING = ("none", "linear", "sqrt", "adascale")
STOP_AT = ("boundary", "micro_batch")
_LEGACY_SCALE = "legacy"  # an open window saved without its gradients' multiplier (see _rescale_window)


@dataclass
class StepInfo:
    """What happened at one optimizer step (handed to ``on_step`` callbacks; one metrics.jsonl line)."""

    epoch: int
    step: int  # optimizer steps completed, this one included
    factor: int  # the scheduled factor of this window
    micro_batches: int  # micro-batches in this window (< factor for a partial window)
    elements: int  # elements (samples or tokens) in this window over all ranks
    samples: int  # samples in this window over all ranks
    loss: float  # mean loss per element over the window, all ranks
    lr: float  # learning rate used by this step
    grad_norm: float | None  # global norm of the normalised gradient, before clipping; None where not measured
    skipped: bool  # non-finite loss/gradient: the optimizer did not step
    loss_scale: float | None = None  # fp16: the GradScaler scale this window was scaled with (None otherwise)
    noise: dict | None = None  # noise_scale=True: the gns_* fields and noise_scale (accum_sched.noise_scale.FIELDS)
    factor_reason: str | None = None  # adaptive: why this window has its factor (the decision that set it)
    beta2: float | None = None  # Adam's beta2 this step ran with (co-scaled where asked); None: no betas
    weight_decay: float | None = None  # weight decay this step ran with (co-scaled where asked); None: no such setting

    def to_dict(self) -> dict:
        """One flat metrics line; the optional fields appear only when their feature is on."""
        out = asdict(self)
        noise, reason = out.pop("noise"), out.pop("factor_reason")
        out.update(noise or {})
        if reason is not None:
            out["factor_reason"] = reason
        return out

    @classmethod
    def from_dict(cls, record: dict) -> StepInfo:
        """The inverse of to_dict (a checkpoint's last step)."""
        from accum_sched.noise_scale import FIELDS

        known = {f.name for f in fields(cls)} - {"noise"}
        noise = {k: record[k] for k in FIELDS if k in record} or None
        return cls(**{k: v for k, v in record.items() if k in known}, noise=noise)


def _batch_size(batch) -> int:
    """Samples in a micro-batch: the leading dimension of its first tensor."""
    if type(batch) in (list, tuple) and batch and type(batch[0]) is torch.Tensor and batch[0].dim():  # (x, y, ...)
        return batch[0].shape[0]
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        for value in batch.values():
            return _batch_size(value)
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (torch.Tensor, dict, list, tuple)):
            return _batch_size(first)
        return len(batch)
    return 1


_END = object()


class AccumulationEngine:
    """Drives scheduled gradient accumulation for a plain module, a DDP module or a DeepSpeed engine.

    Args:
        model: ``nn.Module`` (one process), ``DistributedDataParallel``, a module ``fully_shard`` was applied to
            (FSDP2), or a ``DeepSpeedEngine``.
        optimizer: a torch optimizer (None for a DeepSpeed engine, which owns its own).
        schedule: anything :class:`AccumulationSchedule` accepts (mapping, ``"0:1,5:2"``, int) or a schedule.
        lr_scheduler: stepped once per optimizer step (so its totals are :meth:`AccumulationSchedule.optimizer_steps`).
        max_grad_norm: clip the global gradient norm to this on each step; None (default) never clips.
        normalize: ``"elements"`` (default, exact large-batch mean over every sample/token of the window on all
            ranks) or ``"micro_batches"`` (Lightning-compatible: mean of per-micro-batch means).
        uneven: ranks whose loaders differ in length: ``"truncate"`` (default; all ranks stop at the shortest,
            with a warning) or ``"error"``.
        nonfinite: a non-finite loss or gradient: ``"skip"`` the step on every rank (default) or ``"raise"``.
        precision: ``"fp32"``, ``"bf16"`` (autocast, CPU or GPU) or ``"fp16"`` (autocast + GradScaler, CPU or GPU;
            an overflow is the scaler's normal operation: the step is skipped and counted, never raised, and
            neither the LR scheduler nor a step-keyed schedule advances on it).
        micro_batch_size: samples per micro-batch: reports the effective batch (``micro x factor x world``) and
            lets windows of full micro-batches skip a scaling pass over the gradient (same value on every rank).
        count_allreduce: count DDP gradient all-reduce rounds with a comm hook (default True).
        lr_coupling: scale the learning rate with the effective batch when the factor changes: ``"none"``
            (default), ``"linear"`` (LR x factor / first factor), ``"sqrt"`` (LR x sqrt of that ratio) or
            ``"adascale"`` (AdaScale's gain from the measured noise scale; needs ``noise_scale``). Applied to each
            optimizer step on top of the LR scheduler, which never sees it.
        co_scale: ``{"lr": none|linear|sqrt|auto, "beta2": none|half_life, "weight_decay": none|tau}``: the
            optimizer follows the effective batch (:mod:`accum_sched.co_scale`); ``lr`` is ``lr_coupling`` under
            another name (give one of them). Every step's beta2 and weight decay are in :class:`StepInfo`.
        noise_scale: measure the gradient noise scale of every window (accum_sched.noise_scale): the gns_* fields
            of :class:`StepInfo`. DDP, one process, or DeepSpeed ZeRO-0 in fp32; not fp16 or
            ``normalize="micro_batches"``.
        adaptive: an :class:`~accum_sched.adaptive.AdaptiveFactor` (or a mapping of its arguments) that picks the
            factor from the noise scale instead of ``schedule`` (which must stay the default 1); implies
            ``noise_scale``. Optimizer-step totals are unknown in advance then: an LR scheduler you pass is stepped
            once per step all the same, so use one that does not depend on the total (constant, warm-up).
        stop_at: where :meth:`request_stop` takes effect: ``"boundary"`` (default; the next optimizer step, agreed
            in the window-end collective, no extra communication) or ``"micro_batch"`` (within about one
            micro-batch at any factor: ranks agree through a one-number all-reduce per micro-batch, started after
            each backward and read one micro-batch later on a gloo group of its own, so it never blocks; the open
            window is then saved by :meth:`state_dict`). Back ends that cannot save a partial window (DeepSpeed
            with fp16 weights), and the noise-scale measurement (its per-window sums are not saved), fall back
            to ``"boundary"``.
        norm_every: measure the global gradient norm (``StepInfo.grad_norm``, and with it the check for a non-finite
            gradient) every this many optimizer steps; None: never. It is measured at every step whatever this says
            when clipping, under fp16 (an overflow is a skipped step) and with the noise scale; a non-finite *loss*
            is caught at every step (it travels with the counts, at no cost). Under DDP the norm is taken in the
            comm hook as each bucket arrives; elsewhere it is one fused pass over the gradients. Default None: a
            hand-written loop takes no norm either; the launcher passes ``logging.log_every``. Set 1 to check every
            step's gradient for NaN/inf and report its norm.
        gradient_sync: FSDP2 models only: ``"boundary"`` (default; one reduce-scatter per optimizer step, unsharded
            gradients held inside the window) or ``"every_micro_batch"`` (reduce-scatter each micro-batch into
            sharded gradients; less memory, more traffic) or ``"reduce_scatter"`` (HSDP, a 2-D mesh: reduce-scatter
            each micro-batch inside the shard group, all-reduce across replicas at the boundary only). See
            accum_sched/backends/fsdp.py.
        keep_gathered: FSDP2 models only: keep the gathered parameters from a window's first forward to its last
            backward (one all-gather per parameter group and window; the full parameters held all window).
        read_ahead: streams only (a loader without ``len()``): micro-batches read ahead per end-agreement
            all-reduce (accum_sched/streams.py): an epoch of ``n`` costs ``1 + (n - 1) // read_ahead`` small
            asynchronous all-reduces and holds at most ``read_ahead + 1`` micro-batches ahead. Default 4.
    """

    def __init__(self, model, optimizer=None, schedule=1, *, lr_scheduler=None, max_grad_norm: float | None = None,
                 normalize: str = "elements", uneven: str = "truncate", nonfinite: str = "skip",
                 precision: str = "fp32", micro_batch_size: int | None = None, count_allreduce: bool = True,
                 lr_coupling: str = "none", noise_scale: bool = False, adaptive=None, stop_at: str = "boundary",
                 norm_every: int | None = None, gradient_sync: str = "boundary", keep_gathered: bool = False,
                 read_ahead: int = streams.READ_AHEAD, co_scale: dict | None = None):
        for name, value, allowed in (("normalize", normalize, NORMALIZE), ("uneven", uneven, UNEVEN),
                                     ("nonfinite", nonfinite, NONFINITE), ("precision", precision, PRECISION),
                                     ("lr_coupling", lr_coupling, LR_COUPLING), ("stop_at", stop_at, STOP_AT)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
        if norm_every is not None and not (isinstance(norm_every, int) and norm_every >= 1):
            raise ValueError(f"norm_every={norm_every!r} must be an int >= 1, or None to measure only when clipping")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0, or None for no clipping")
        self.schedule = AccumulationSchedule(schedule)
        self.adaptive = None
        if adaptive is not None:
            from accum_sched.adaptive import AdaptiveFactor

            if self.schedule.milestones != AccumulationSchedule(1).milestones:
                raise ValueError("give either a schedule or adaptive=, not both")
            self.adaptive = AdaptiveFactor.build(adaptive)
            noise_scale = True
        if lr_coupling == "adascale" and not noise_scale:
            raise ValueError("lr_coupling='adascale' needs the noise scale: set noise_scale=True (or adaptive=)")
        self.model = model
        self.normalize, self.uneven, self.nonfinite = normalize, uneven, nonfinite
        self.max_grad_norm = max_grad_norm
        self.precision = precision
        self.lr_coupling = lr_coupling
        self.micro_batch_size = micro_batch_size
        self.norm_every = norm_every
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 1:
            raise ValueError(f"read_ahead={read_ahead!r} must be an int >= 1")
        self.read_ahead = read_ahead
        # fp16: torch back ends run a GradScaler (backend.scaler); DeepSpeed's fp16 brings its own loss scaler
        self.backend = make_backend(model, optimizer, lr_scheduler, precision=precision,
                                    count_allreduce=count_allreduce, gradient_sync=gradient_sync,
                                    keep_gathered=keep_gathered)
        self.world_size = self.backend.world_size
        self.callbacks: list[Callable[[StepInfo], None]] = []
        self.co_scale = self._make_co_scale(co_scale, lr_coupling)
        self.noise = self._make_noise() if noise_scale else None

        # position and counters (all identical on every rank; see state_dict)
        self.epoch_index = 0  # the epoch to run next (or running)
        self.micro_in_epoch = 0  # micro-batches of epoch_index already consumed (always at a window boundary)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.overflow_steps = 0  # fp16 windows the GradScaler skipped (also in skipped_steps)
        self.micro_steps = 0  # micro-batches run on this rank
        self.elements = 0  # global
        self.samples = 0  # global
        self.factor = self._factor_for()
        self.last_step: StepInfo | None = None
        self._rounds_offset = 0
        self._stop_requested = False
        self.should_stop = False

        # the open window
        self._expect_backward = False
        self._win_losses: list[torch.Tensor] = []  # the window's detached losses, summed once at its end
        self._win_loss_carried = 0.0  # this rank's loss sum of a window left open by a stop (resumed)
        self._win_n: int | torch.Tensor | None = None  # element count: an int, or a tensor if the loss gave one
        self._win_samples = 0
        self._boundary = False  # the micro-batch handed out last ends its window
        self._prescale = 1.0  # loss multiplier of the open window (see _window_prescale)
        self._prescale_size = 1  # ... and the window size it assumed (a stream's window may end short)
        self.stream_collectives = 0  # the small all-reduces that agree where streams end (none for sized loaders)
        self._want_norm = False  # whether the open window's gradient norm is measured
        self._win_start: int | None = None  # micro-batch (in its epoch) where a window left open by a stop began
        self._win_grad_scale = None  # the loss multiplier a resumed open window's gradients carry

        # stopping inside a window (see resume.py): needs a back end that can hand out its local gradients
        # (and no per-micro-batch state of its own outside the gradients: the noise scale's sums are not saved)
        partial_ok = self.backend.capabilities.stop_mid_window and self.noise is None
        self.stop_at = stop_at if partial_ok else "boundary"
        self._stop_poll = StopPoll(self.world_size) if self.stop_at == "micro_batch" else None

    # -- public counters ----------------------------------------------------------------------------------------
    @property
    def allreduce_rounds(self) -> int | None:
        """Gradient all-reduce rounds so far, as counted by the back end (DDP comm hook); None if not counted."""
        rounds = self.backend.allreduce_rounds
        return None if rounds is None else rounds + self._rounds_offset

    @property
    def effective_batch(self) -> int | None:
        """Samples per optimizer step at the current factor (``micro x factor x world``), if the micro-batch is
        known."""
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.factor * self.world_size

    def on_step(self, callback: Callable[[StepInfo], None]) -> Callable[[StepInfo], None]:
        """Register ``callback(StepInfo)``, called on every rank after each optimizer step. Usable as a decorator."""
        self.callbacks.append(callback)
        return callback

    def request_stop(self) -> None:
        """Ask to stop (safe from a signal handler: it only sets a flag), at the next optimizer boundary or, with
        ``stop_at="micro_batch"``, within about one micro-batch.

        Ranks agree on it by collective, so every rank stops after the same micro-batch and :attr:`should_stop`
        becomes True everywhere. A stop inside a window leaves it open (:attr:`window_open`): save
        :meth:`state_dict` on every rank, it holds this rank's accumulated gradient.
        """
        self._stop_requested = True

    @property
    def window_open(self) -> bool:
        """True between micro-batches of an unfinished window, e.g. after a stop inside it."""
        return self._win_n is not None

    def resume_offset(self, epoch: int) -> int:
        """Micro-batches of ``epoch`` already trained: where a positioned loader must start (0 unless resuming it).

        With a loader that starts there (e.g. a DataLoader over :class:`accum_sched.ResumeSampler`), pass
        ``skip=False`` to :meth:`micro_batches`: nothing before the resume point is loaded.
        """
        return self.micro_in_epoch if epoch == self.epoch_index else 0

    def _position(self) -> Position:
        # fp16 overflow steps took no optimizer step, so a step-keyed schedule does not count them (as the LR scheduler)
        return Position(epoch=self.epoch_index, step=self.optimizer_steps - self.overflow_steps, samples=self.samples,
                        tokens=self.elements)

    def _factor_for(self) -> int:
        """The factor of the window starting now: the adaptive controller's, or the schedule's."""
        if self.adaptive is None and self.schedule.unit == "epoch":  # the usual case, once per window
            return self.schedule.factor_at(self.epoch_index)
        return (self.adaptive or self.schedule).factor_for(self._position())

    def _make_noise(self):
        """The noise-scale measurement (accum_sched.noise_scale), refused where the local gradient is not at hand."""
        from accum_sched.noise_scale import WindowNoise

        if self.normalize != "elements":
            raise ValueError("noise_scale needs normalize='elements' (the estimator works on per-element means)")
        if self.backend.capabilities.noise_scale is None:  # its probes read DDP buckets or whole local gradients
            raise ValueError(f"noise_scale / adaptive are not measured with {self.backend.name} yet; use DDP or "
                             f"DeepSpeed ZeRO-0")
        if self.precision == "fp16":
            raise ValueError("noise_scale is not measured under fp16 (loss-scaled local gradients); use bf16 or fp32")
        if self.adaptive is not None and self.world_size == 1 and self.adaptive.min_factor < 2:
            raise ValueError("adaptive in one process needs min_factor >= 2: the noise scale is estimated from the "
                             "micro-batches of a window, and a window of one micro-batch has a single batch size")
        return WindowNoise(self.backend, self.adaptive.ema if self.adaptive is not None else 0.95)

    # -- the loop -----------------------------------------------------------------------------------------------
    def autocast(self):
        """Context for the forward pass under the configured precision (a no-op for fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        device = module_device(self.model).type  # CPU autocast takes float16 too
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        return torch.autocast(device_type=device, dtype=dtype)

    def micro_batches(self, loader: Iterable, epoch: int | None = None, num_batches: int | None = None, *,
                      skip: bool = True) -> Iterator:
        """Yield the micro-batches of ``epoch``, each inside the right gradient-sync context.

        Call :meth:`backward` once for every batch before asking for the next. When :attr:`should_stop` turns True
        the iteration ends early (at a step boundary, or inside a window with ``stop_at="micro_batch"``).

        ``loader`` may be a stream (an iterable without ``len()``, e.g. over an ``IterableDataset``): the epoch then
        ends where the shortest rank's stream ends (``uneven='error'`` raises on every rank instead), and a window
        the end cuts short is stepped at its real size. The ranks agree on the end as it comes, without waiting:
        the engine reads up to ``read_ahead + 1`` micro-batches ahead and sums their has-flags in one small
        asynchronous all-reduce per ``read_ahead`` reads (:mod:`accum_sched.streams`; :attr:`stream_collectives`
        counts them). ``num_batches``, where given, is
        the length instead (agreed once at the epoch's start, as ``len()`` is).

        Resuming mid-epoch (after :meth:`load_state_dict`), the first :meth:`resume_offset` micro-batches of the
        epoch were trained already. ``skip=True`` (default): ``loader`` yields the whole epoch and the engine reads
        and discards those (simple, but it loads them). ``skip=False``: ``loader`` is positioned already and yields
        only the rest; its ``len()`` (or ``num_batches``) counts only the rest. The engine never skips twice.
        """
        epoch = self.epoch_index if epoch is None else epoch
        if epoch < self.epoch_index:
            raise ValueError(f"epoch {epoch} was already trained (the engine is at epoch {self.epoch_index})")
        if epoch > self.epoch_index:
            if self.window_open:
                raise RuntimeError(f"epoch {self.epoch_index} stopped inside a window; finish it before epoch {epoch}")
            self.epoch_index, self.micro_in_epoch = epoch, 0
        if num_batches is None and not streams.has_length(loader):
            yield from self._stream_micro_batches(loader, epoch, skip)
            return
        if num_batches is None:
            num_batches = len(loader)
        start = self.micro_in_epoch
        if not skip:
            num_batches += start  # the loader yields only what remains
        total = self._agree_epoch(epoch, num_batches, start)
        iterator = iter(loader) if start < total else iter(())
        if skip:
            for _ in range(start if start < total else 0):  # trained before the checkpoint: loaded and dropped
                next(iterator)
        consumed = start if self._win_start is None else self._win_start  # a window left open goes on
        self._win_start = None
        while consumed < total and not self.should_stop:
            factor = self._factor_for()
            size = min(factor, total - consumed)
            self._open_window(factor, size)
            for j in range(self.micro_in_epoch - consumed, size):
                try:
                    batch = next(iterator)
                except StopIteration:
                    raise RuntimeError(f"epoch {epoch}: the loader ended after {consumed + j} micro-batches but "
                                       f"len() promised {num_batches}") from None
                boundary = j == size - 1
                yield from self._micro_batch(batch, boundary)
                stop = self._after_micro_batch(consumed, j, boundary)
                if stop and not boundary:
                    return
            consumed += size
            self._finish_window(epoch, factor, size)
            self.should_stop = self.should_stop or stop
        self._end_epoch(epoch)

    def _stream_micro_batches(self, loader: Iterable, epoch: int, skip: bool) -> Iterator:
        """:meth:`micro_batches` for an iterable without ``len()``: the epoch ends where the shortest rank's
        stream does (:class:`accum_sched.streams.StreamReader` says so one micro-batch ahead, on every rank), and a
        window cut short by that end is stepped at its real size."""
        start = self.micro_in_epoch
        self._agree_epoch(epoch, None, start)
        iterator = iter(loader)
        if skip:
            for _ in range(start):  # trained before the checkpoint: loaded and dropped
                if next(iterator, _END) is _END:
                    break
        reader = streams.StreamReader(iterator, uneven=self.uneven, context=f"epoch {epoch}",
                                      read_ahead=self.read_ahead, first_index=start)
        self.stream_collectives += reader.collectives
        consumed = start if self._win_start is None else self._win_start
        self._win_start = None
        ended = False
        try:
            while not ended and not self.should_stop:
                factor = self._factor_for()
                self._open_window(factor, factor)  # full until the stream says otherwise
                j, stop = self.micro_in_epoch - consumed, False
                while j < factor:
                    before = reader.collectives
                    item = reader.next()
                    self.stream_collectives += reader.collectives - before
                    if item is None:  # nothing left on some rank (only at a window's start: the last was known)
                        ended = True
                        break
                    batch, ended = item
                    boundary = ended or j == factor - 1
                    yield from self._micro_batch(batch, boundary)
                    stop = self._after_micro_batch(consumed, j, boundary)
                    if stop and not boundary:
                        return
                    j += 1
                    if boundary:
                        break
                if j == 0:
                    break
                consumed += j
                self._finish_window(epoch, factor, j)
                self.should_stop = self.should_stop or stop
        finally:
            reader.close()
        self._end_epoch(epoch)

    def _open_window(self, factor: int, size: int) -> None:
        """A window of ``factor`` begins (``size`` micro-batches as far as is known now)."""
        self.factor = factor
        self._prescale = self._window_prescale(size)
        self._prescale_size = size
        if self._win_grad_scale is not None:  # the window left open by a stop goes on: its gradients' scale
            self._rescale_window()

    def _micro_batch(self, batch, boundary: bool) -> Iterator:
        """Hand out one micro-batch inside its gradient-sync context; its backward must come before the next."""
        self._boundary = boundary
        with self.backend.sync_context(boundary):
            self._expect_backward = True
            self._win_samples += _batch_size(batch)
            yield batch
            if self._expect_backward:
                raise RuntimeError("call engine.backward(loss_sum, n_elements) for every micro-batch "
                                   "before taking the next one")

    def _after_micro_batch(self, consumed: int, j: int, boundary: bool) -> bool:
        """Count it and poll the stop flag; off a boundary a stop leaves the window open (for state_dict()) and sets
        should_stop. Returns the poll's answer."""
        self.micro_in_epoch = consumed + j + 1
        stop = self._stop_poll is not None and self._stop_poll.poll(self._stop_requested)
        if stop and not boundary:  # every rank stops here; the window stays open for state_dict()
            self._win_start = consumed
            self.should_stop = True
        return stop

    def _end_epoch(self, epoch: int) -> None:
        if self._stop_poll is not None:  # no poll left in flight past the epoch (the next thing may be a save)
            self.should_stop = self._stop_poll.drain() or self.should_stop
        if not self.should_stop:
            self.epoch_index, self.micro_in_epoch = epoch + 1, 0

    def _agree_epoch(self, epoch: int, num_batches: int | None, start: int) -> int:
        """Agreement at an epoch's start; returns the micro-batches every rank trains (-1 for a stream, whose end
        is agreed as it comes)."""
        factor = self._factor_for()
        ranges = collective.agree(
            {"accumulation factor": factor, "schedule fingerprint": (self.adaptive or self.schedule).fingerprint(),
             "resume position": start, "micro-batches per epoch": -1 if num_batches is None else num_batches,
             "micro-batch size": self.micro_batch_size or 0},
            context=f"at the start of epoch {epoch}", allow=("micro-batches per epoch",))
        low, high = ranges["micro-batches per epoch"]
        if num_batches is None:
            return -1
        if low != high:
            message = (f"epoch {epoch}: ranks have between {low} and {high} micro-batches (this rank {num_batches})")
            if self.uneven == "error":
                raise collective.RankDisagreement(message + "; give every rank the same number (DistributedSampler "
                                                  "pads to equal lengths) or set uneven='truncate'")
            if collective.rank() == 0:
                warnings.warn(message + f"; every rank trains the first {low} (uneven='truncate')", stacklevel=3)
        if low < factor and collective.rank() == 0 and low > start:
            warnings.warn(f"epoch {epoch} has {low} micro-batches, fewer than the factor {factor}: it takes one "
                          f"optimizer step over all of them", stacklevel=3)
        return low

    def backward(self, loss_sum: torch.Tensor, n_elements) -> None:
        """Backward of one micro-batch. ``loss_sum`` is the SUM of per-element losses, ``n_elements`` their count.

        The sum is back-propagated (times one constant per window when ``micro_batch_size`` is known); the
        window's gradient is divided by the global element count once, at the boundary, which makes the step
        exactly that of one batch made of the whole window.
        """
        if not self._expect_backward:
            raise RuntimeError("engine.backward() must be called once per micro-batch from engine.micro_batches()")
        self._expect_backward = False
        n = n_elements.detach() if isinstance(n_elements, torch.Tensor) else n_elements
        # kept where they are (a device tensor stays on the device): nothing here waits for the device, and no
        # tensor operation: the window's losses are summed once, at its end (_window_loss)
        loss_value = loss_sum.detach()
        self._win_losses.append(loss_value.reshape(()) if loss_value.dim() else loss_value)
        self._win_n = n if self._win_n is None else self._win_n + n
        if self._boundary:
            self._send_window_stats(loss_sum.device)
        if self.normalize == "micro_batches":
            self.backend.backward(loss_sum / n)
        elif self._prescale != 1.0:
            self.backend.backward(loss_sum * self._prescale)
        else:
            self.backend.backward(loss_sum)
        if self.noise is not None:
            self.noise.after_backward(torch.as_tensor(n, dtype=torch.float64), self._prescale, self._boundary)
        self.micro_steps += 1

    @property
    def _averaging(self) -> int:
        """What the back end's gradient collective divides by: the world size for DDP's mean, else 1."""
        return self.world_size if self.backend.averages_over_world else 1

    def _window_prescale(self, size: int) -> float:
        """Loss multiplier for a window of ``size`` micro-batches: 1/(its global element count, if it is full).

        With ``micro_batch_size`` known, every micro-batch's loss is multiplied by the share a window of full
        micro-batches gives it, so DDP's all-reduce already delivers the exact mean and the boundary has nothing
        left to scale (the correction in _finish_window is exactly 1.0 and the back end skips a pass over every
        gradient). A short micro-batch or token counts make the correction differ from 1 and it is applied then.
        The multiplier is the same on every rank (the micro-batch size is agreed at each epoch start).
        """
        if (self.micro_batch_size is None or self.normalize != "elements"
                or not self.backend.capabilities.prescale):
            return 1.0
        return self._averaging / (self.micro_batch_size * size * self.world_size)

    def _rescale_window(self) -> None:
        """Bring the local gradients of a resumed open window to this window's loss multiplier. They carry the one
        they were accumulated with; a checkpoint without it was written when the DDP back end averaged in its comm
        hook, so its multiplier held the world size (``world / (micro x size x world)`` where one was used)."""
        saved, self._win_grad_scale = self._win_grad_scale, None
        if saved is _LEGACY_SCALE:
            saved = self._prescale
            if self._prescale != 1.0 and not self.backend.averages_over_world:
                saved = self._prescale * self.world_size
        if saved != self._prescale and saved:
            scale_gradients(self.backend.local_grad_tensors(), self._prescale / saved)

    def _window_loss(self) -> torch.Tensor:
        """This rank's sum of the window's losses, on the losses' device: the loss itself for a window of one
        micro-batch, else one float64 sum (two tensor operations per window, none per micro-batch)."""
        losses = self._win_losses
        if len(losses) == 1 and not self._win_loss_carried:
            return losses[0]
        if not losses:
            return torch.tensor(self._win_loss_carried, dtype=torch.float64)
        total = torch.stack(losses).sum(dtype=torch.float64)
        return total + self._win_loss_carried if self._win_loss_carried else total

    def _send_window_stats(self, device: torch.device) -> None:
        """Hand the window's numbers to the back end before its last backward: the loss and element count of the
        last micro-batch are known before its backward, so they can travel inside that backward's gradient
        all-reduce (DDP) or in an all-reduce that overlaps it."""
        # measured where something needs it: clipping, fp16 overflow detection, the noise scale, the cadence
        self._want_norm = (self.max_grad_norm is not None or self.precision == "fp16" or self.noise is not None or (
            self.norm_every is not None and (self.optimizer_steps + 1) % self.norm_every == 0))
        stats = window_stats.encode(self._win_n, self._win_samples, self._window_loss(), self._stop_requested,
                                    self.backend.stats_dtype, device)
        self.backend.send_window_stats(stats, self._want_norm)

    def train_epoch(self, loader: Iterable, loss_fn: Callable, epoch: int | None = None, *, skip: bool = True) -> None:
        """Run one epoch: ``loss_fn(model, batch) -> (loss_sum, n_elements)`` on every micro-batch (``skip``: see
        :meth:`micro_batches`)."""
        for batch in self.micro_batches(loader, epoch, skip=skip):
            with self.autocast():
                loss_sum, n = loss_fn(self.model, batch)
            self.backward(loss_sum, n)

    def _finish_window(self, epoch: int, factor: int, size: int) -> None:
        totals = self._read_totals()
        skip, overflow, loss_scale = self._check_finite(totals, epoch)
        coef = self._coefficient(size, totals.elements)
        grad_norm = None if totals.grad_norm is None else totals.grad_norm * coef
        noise = None
        if self.noise is not None:  # one all-reduce of four numbers (accum_sched.noise_scale); the norm is measured
            noise = self.noise.finish_window(grad_norm * grad_norm, coef, float(totals.elements), update=not skip)
        info = self._step(epoch, factor, size, totals, coef, skip, grad_norm, noise, loss_scale)
        self._advance(totals, skip, overflow, noise, size)
        self._report(info, overflow)

    def _read_totals(self) -> window_stats.WindowTotals:
        """The window's numbers summed over ranks and its gradient norm: the one host transfer of the step."""
        stats, squared_norm = self.backend.window_totals(self._want_norm)
        values = stats if stats.dim() == 1 else stats.reshape(-1)
        if squared_norm is not None:
            values = torch.cat([values.to(torch.float64), squared_norm.reshape(1).to(values.device, torch.float64)])
        return window_stats.decode(values.tolist())  # the host sync of this optimizer step

    def _check_finite(self, totals: window_stats.WindowTotals, epoch: int) -> tuple[bool, bool, float | None]:
        """(skip the step, an fp16 overflow, this window's loss scale); raises under nonfinite='raise'.

        Every rank holds the same summed numbers and the same reduced gradient, so every rank reaches the same
        verdict without another collective. fp16: the scaler found inf/NaN in the (all-reduced, hence identical)
        gradient, or a rank's scaled loss overflowed. That is how dynamic loss scaling works, not an error: skip,
        back the scale off, never raise.
        """
        nonfinite = totals.nonfinite or (totals.grad_norm is not None and not math.isfinite(totals.grad_norm))
        scaler = self.backend.scaler
        # before update(): this window's scale; a back end's own fp16 scaling (DeepSpeed) counts alike
        loss_scale = self.backend.native_loss_scale() if scaler is None else float(scaler.get_scale())
        overflow = nonfinite and loss_scale is not None
        if nonfinite and self.nonfinite == "raise" and not overflow:
            raise FloatingPointError(f"non-finite loss or gradient at epoch {epoch}, step {self.optimizer_steps + 1} "
                                     f"(nonfinite='raise'; use nonfinite='skip' to skip such steps)")
        return nonfinite or totals.elements == 0, overflow, loss_scale

    def _coefficient(self, size: int, elements: int) -> float:
        """What the window's gradient, as the collective left it, must be multiplied by to be the large-batch mean."""
        if self.normalize == "micro_batches":
            return 1.0 / size
        if self._prescale != 1.0:  # already divided by the count of the window it assumed; correct for the real one
            return (self.micro_batch_size * self._prescale_size * self.world_size) / max(elements, 1)
        return self._averaging / max(elements, 1)

    def _step(self, epoch: int, factor: int, size: int, totals: window_stats.WindowTotals, coef: float,
              skip: bool, grad_norm: float | None, noise: dict | None, loss_scale: float | None) -> StepInfo:
        """Let the back end scale, clip and step; returns what this step was."""
        lr_scale = self._lr_scale(factor, noise, size, float(totals.elements))
        lr = self.backend.lr() * lr_scale
        scale = self._group_scale(factor, lr_scale)
        beta2, weight_decay = co_scale.reported(self.backend.param_groups(), scale)
        # a back end with its own batch bookkeeping (DeepSpeed's GAS, global_samples); a no-op elsewhere
        self.backend.on_window(factor, size, totals.samples)
        if scale == 1.0:
            self.backend.step(coef, self.max_grad_norm, totals.grad_norm, skip)
        else:
            self.backend.step(coef, self.max_grad_norm, totals.grad_norm, skip, lr_scale=scale)
        elements = totals.elements
        return StepInfo(epoch=epoch, step=self.optimizer_steps + 1, factor=factor, micro_batches=size,
                        elements=elements, samples=totals.samples,
                        loss=totals.loss / elements if elements else float("nan"), lr=lr, grad_norm=grad_norm,
                        skipped=skip, loss_scale=loss_scale, noise=noise,
                        factor_reason=None if self.adaptive is None else self.adaptive.reason, beta2=beta2,
                        weight_decay=weight_decay)

    def _advance(self, totals: window_stats.WindowTotals, skip: bool, overflow: bool, noise: dict | None,
                 size: int) -> None:
        """Counters move on, the adaptive controller decides the next factor, and the window closes."""
        self.optimizer_steps += 1
        self.skipped_steps += int(skip)
        self.overflow_steps += int(overflow)
        self.elements += totals.elements
        self.samples += totals.samples
        self.should_stop = totals.stop
        if self.adaptive is not None:  # decides the next window's factor from all-reduced numbers only
            self.adaptive.after_window(self.optimizer_steps, noise["noise_scale"], float(totals.elements), size)
        self._win_losses, self._win_n, self._win_loss_carried = [], None, 0.0
        self._win_samples = 0

    def _report(self, info: StepInfo, overflow: bool) -> None:
        self.last_step = info
        if overflow:
            log.info("step %d skipped: fp16 overflow at loss scale %g", info.step, info.loss_scale)
        elif info.skipped and collective.rank() == 0:
            log.warning("step %d skipped: %s", info.step,
                        "no elements in the window" if info.elements == 0 else "non-finite loss or gradient")
        for callback in self.callbacks:
            callback(info)

    def _make_co_scale(self, rules: dict | None, lr_coupling: str) -> dict:
        """``co_scale`` with its defaults, ``lr: auto`` fixed for this optimizer; ``lr_coupling`` is its ``lr``."""
        rules = co_scale.validate(rules)
        if lr_coupling != "none":
            if rules["lr"] not in ("none", lr_coupling):
                raise ValueError(f"lr_coupling={lr_coupling!r} and co_scale lr={rules['lr']!r} disagree: give one")
            if lr_coupling != "adascale":  # AdaScale's gain is the LR rule then; beta2 and weight decay may follow
                rules["lr"] = lr_coupling
        optimizer = getattr(self.backend, "optimizer", None)
        name = "the optimizer" if optimizer is None else type(optimizer).__name__
        rules = co_scale.resolve(rules, self.backend.param_groups(), name)
        if rules["lr"] != "none":
            self.lr_coupling = rules["lr"]
        return rules

    def _group_scale(self, factor: int, lr_scale: float):
        """What this step changes in the optimizer's groups: the LR multiplier alone (a float), or a GroupScale
        when beta2 or weight decay follow the batch too (accum_sched.co_scale)."""
        rules = self.co_scale
        if rules["beta2"] == "none" and rules["weight_decay"] == "none":
            return lr_scale
        from accum_sched import co_scale

        scale = co_scale.group_scale(rules, factor / (self.adaptive or self.schedule).factor_at(0), lr_scale)
        return lr_scale if scale.is_identity() else scale

    def _lr_scale(self, factor: int, noise: dict | None = None, size: int = 1, n_total: float = 0.0) -> float:
        """LR multiplier for a window of ``factor``: effective batch relative to the schedule's first factor.

        Linear keeps LR / batch constant (Goyal et al. 2017); sqrt keeps the update noise's variance constant.
        Smith et al. 2017 argue the other way round (grow the batch *instead of* decaying the LR), which is why
        the default is none. AdaScale (Johnson et al. 2020) uses the gain (B_noise/B0 + 1) / (B_noise/B + 1) of
        this window's batch B over the first factor's batch B0 (between 1 and B/B0; 1 while there is no estimate).
        """
        if self.lr_coupling == "none":
            return 1.0
        first = (self.adaptive or self.schedule).factor_at(0)
        if self.lr_coupling == "adascale":
            b_noise = None if noise is None else noise["noise_scale"]
            if b_noise is None or not b_noise > 0 or not n_total > 0:
                return 1.0
            batch = float(n_total)
            base = batch * first / size  # the first factor's batch at this window's elements per micro-batch
            return (b_noise / base + 1.0) / (b_noise / batch + 1.0)
        ratio = factor / first
        return ratio if self.lr_coupling == "linear" else ratio ** 0.5

    # -- resume -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The engine's position and counters (plain ints), the same on every rank; taken between windows, or
        after a stop inside one. Then it also holds ``"window"``: where the open window began, this rank's share
        of its loss, element and sample counts, and this rank's accumulated (not yet reduced) gradients, so it
        differs per rank: save every rank's and give each rank its own back."""
        if self._expect_backward or (self.window_open and not self.should_stop):
            raise RuntimeError("engine.state_dict() inside a window: save from an on_step callback, between epochs, "
                               "or after a stop (should_stop)")
        state = {
            "epoch": self.epoch_index, "micro_batch": self.micro_in_epoch,
            "optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
            "overflow_steps": self.overflow_steps, "micro_batches": self.micro_steps, "elements": self.elements,
            "samples": self.samples,
            "allreduce_rounds": self.allreduce_rounds or 0, "factor": self.factor, "world_size": self.world_size,
            "schedule": [list(m) for m in self.schedule.milestones], "unit": self.schedule.unit,
            "backend": self.backend.state_dict(), **self._noise_state(),
        }
        if self.window_open:
            state["window"] = {"start": self._win_start, "loss": float(self._window_loss()),
                               "elements": float(self._win_n), "grad_scale": self._prescale,
                               "samples": self._win_samples, "grads": self.backend.local_grads()}
        return state

    def _noise_state(self) -> dict:
        """The noise-scale EMAs and the adaptive controller's decisions (resume repeats them bit for bit)."""
        out = {}
        if self.noise is not None:
            out["noise_scale"] = self.noise.estimator.state_dict()
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next :meth:`micro_batches` call skips what was already trained."""
        self.epoch_index = int(state["epoch"])
        self.micro_in_epoch = int(state["micro_batch"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.overflow_steps = int(state.get("overflow_steps", 0))
        self.micro_steps = int(state["micro_batches"])
        self.elements = int(state["elements"])
        self.samples = int(state.get("samples", 0))
        self._rounds_offset = int(state.get("allreduce_rounds", 0)) - (self.backend.allreduce_rounds or 0)
        if self.noise is not None and "noise_scale" in state:
            self.noise.estimator.load_state_dict(state["noise_scale"])
        if self.adaptive is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])
        self.factor = self._factor_for()
        self.should_stop = self._stop_requested = False
        self.backend.load_state_dict(state.get("backend", {}))
        window = state.get("window")
        self._win_start = None if window is None else int(window["start"])
        self._win_losses = []
        self._win_loss_carried = 0.0 if window is None else float(window["loss"])
        # the multiplier the saved local gradients carry (absent: written before this field, see _rescale_window)
        self._win_grad_scale = None if window is None else window.get("grad_scale", _LEGACY_SCALE)
        self._win_n = None if window is None else torch.tensor(window["elements"], dtype=torch.float64)
        self._win_samples = 0 if window is None else int(window["samples"])
        if window is not None:
            self.backend.load_local_grads(window["grads"])

    def counters(self) -> dict:
        """Counters for summaries: steps, micro-batches, elements, samples, all-reduce rounds, factor, batch."""
        return {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
                "overflow_steps": self.overflow_steps,
                "micro_batches": self.micro_steps, "elements": self.elements, "samples": self.samples,
                "allreduce_rounds": self.allreduce_rounds, "factor": self.factor,
                "effective_batch": self.effective_batch, "stream_collectives": self.stream_collectives}


class StopPoll:
    """Agree on a stop flag once per micro-batch without waiting for it: each poll reads the sum started by the
    previous one and starts the next, so the all-reduce of one number overlaps a whole micro-batch. All ranks see
    the same sums in the same order, hence stop after the same micro-batch (one after the request reached a rank).
    In one process the flag is read directly."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.group = collective.side_group() if world_size > 1 else None
        self._flag: torch.Tensor | None = None
        self._work = None

    def poll(self, requested: bool) -> bool:
        if self.world_size == 1:
            return requested
        agreed = self.drain()
        if not agreed:
            self._flag = torch.tensor([float(requested)], dtype=torch.float64)
            self._work = collective.all_sum_async(self._flag, group=self.group)
        return agreed

    def drain(self) -> bool:
        """Wait for the poll in flight, if any; True if some rank had asked to stop."""
        if self._flag is None:
            return False
        if self._work is not None:
            self._work.wait()
        agreed = bool(self._flag.item() > 0)  # a CPU tensor on a gloo group: no device sync
        self._flag = self._work = None
        return agreed


def optimizer_steps(schedule, batches_per_epoch, epochs: int) -> int:
    """Exact optimizer steps for ``schedule`` (see :meth:`AccumulationSchedule.optimizer_steps`)."""
    return AccumulationSchedule(schedule).optimizer_steps(batches_per_epoch, epochs)


__all__ = ["AccumulationEngine", "StepInfo", "optimizer_steps"]
