"""AccumulationEngine: scheduled gradient accumulation that is exact and keeps ranks in lockstep.

Use from any loop::

    engine = AccumulationEngine(ddp_model, optimizer, {0: 1, 5: 2, 10: 4}, lr_scheduler=sched)
    for epoch in range(engine.epoch_index, epochs):
        sampler.set_epoch(epoch)
        for batch in engine.micro_batches(loader, epoch):
            with engine.autocast():
                loss_sum, n = loss_fn(ddp_model, batch)   # sum of element losses, number of elements
            engine.backward(loss_sum, n)

Windows start at each epoch start; an epoch's last window may be partial and is stepped at the epoch end. The
optimizer sees the gradient of the mean loss over every element of the window on every rank: one large batch. The
ranks agree on the factor, the schedule and the epoch's length at every epoch start, and sum the window's numbers at
its end (under DDP inside the gradient all-reduce); the host reads them, with the norm, in one transfer per step.

The engine is one micro-batch loop (here) over parts, each in its own module: the back end
(:mod:`accum_sched.backends`), the epoch's feed, sized or streamed (:mod:`accum_sched.epoch_feed`), the open window
(:mod:`accum_sched.open_window`), the optimizer rules (LR coupling, AdaScale, co-scaling,
:mod:`accum_sched.optimizer_rules`), the noise scale and adaptive factor (:mod:`accum_sched.noise_tracking`), the
stop poll (:mod:`accum_sched.stop_poll`) and its saved state (:mod:`accum_sched.engine_state`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator

import torch

from accum_sched import collective, engine_options, engine_state, epoch_feed, streams, window_stats
from accum_sched.backends.base import module_device
from accum_sched.backends.registry import resolve_backend
from accum_sched.invariant import EmptyMicroBatch
from accum_sched.open_window import OpenWindow
from accum_sched.optimizer_rules import OptimizerRules
from accum_sched.schedule import AccumulationSchedule, Position
from accum_sched.step_info import StepInfo
from accum_sched.step_rules import scale_gradients
from accum_sched.stop_poll import StopPoll

log = logging.getLogger("accum_sched")


class AccumulationEngine:
    """Drives scheduled gradient accumulation for a plain module, a DDP module, an FSDP2 (``fully_shard``) module
    or a DeepSpeed engine. docs/guide.md describes every argument; in short:

    ``model`` (and ``optimizer``, None for a DeepSpeed engine, which owns its own) and ``schedule`` (anything
    :class:`AccumulationSchedule` accepts). ``backend``: a back end the caller built (``DDPBackend(model,
    optimizer, precision=...)``, ...; then ``optimizer``, ``lr_scheduler`` and back-end options are given to it, not
    here, and ``precision`` is its own); None (default): the registry picks the back end from the model type and
    builds it with ``precision`` and ``**backend_options`` (DDP: ``count_allreduce``; FSDP2: ``gradient_sync``,
    ``keep_gathered``; an option the chosen back end does not take is a TypeError naming it). ``lr_scheduler``:
    stepped once per optimizer step. ``max_grad_norm``: clip the global norm (None: never). ``normalize``:
    ``"elements"`` (the exact large-batch mean) or ``"micro_batches"`` (Lightning's rule). ``uneven``: ``"truncate"``
    or ``"error"``. ``nonfinite``: ``"skip"`` or ``"raise"``. ``precision``: ``"fp32"`` (default), ``"bf16"``,
    ``"fp16"``. ``micro_batch_size``: samples per micro-batch (reported batch; full windows skip a scaling pass).
    ``lr_coupling`` / ``co_scale``: the optimizer follows the effective batch (:mod:`accum_sched.optimizer_rules`).
    ``noise_scale`` / ``adaptive``: measure the gradient noise scale, and let it pick the factor
    (:mod:`accum_sched.noise_tracking`). ``stop_at``: ``"boundary"`` or ``"micro_batch"``
    (:mod:`accum_sched.stop_poll`); ``stop_poll_every``: with ``"micro_batch"``, the ranks' stop poll communicates on
    every this many micro-batches (default 1: a stop within 2 micro-batches of the request; k: within 2k, at 1/k of
    the poll's all-reduces), ``stop_poll_min_ms``: and no more often than once per this many milliseconds of
    training (default 0: no floor). ``norm_every``: measure the gradient norm every this many steps.
    ``read_ahead``: how far streams read ahead (:mod:`accum_sched.streams`).
    """

    def __init__(self, model, optimizer=None, schedule=1, *, backend=None, lr_scheduler=None,
                 max_grad_norm: float | None = None, normalize: str = "elements", uneven: str = "truncate",
                 nonfinite: str = "skip", precision: str | None = None, micro_batch_size: int | None = None,
                 lr_coupling: str = "none", noise_scale: bool = False, adaptive=None, stop_at: str = "boundary",
                 norm_every: int | None = None, read_ahead: int = streams.READ_AHEAD, co_scale: dict | None = None,
                 stop_poll_every: int = 1, stop_poll_min_ms: float = 0.0, **backend_options):
        self.schedule = AccumulationSchedule(schedule)
        engine_options.check(normalize=normalize, uneven=uneven, nonfinite=nonfinite, lr_coupling=lr_coupling,
                             stop_at=stop_at, norm_every=norm_every, max_grad_norm=max_grad_norm,
                             read_ahead=read_ahead, stop_poll_every=stop_poll_every, stop_poll_min_ms=stop_poll_min_ms,
                             adaptive=adaptive, noise_scale=noise_scale,
                             schedule_given=self.schedule.milestones != AccumulationSchedule(1).milestones)
        noise_scale = noise_scale or adaptive is not None  # the adaptive factor follows the noise scale
        self.model = model
        self.normalize, self.uneven, self.nonfinite = normalize, uneven, nonfinite
        self.max_grad_norm, self.micro_batch_size, self.norm_every = max_grad_norm, micro_batch_size, norm_every
        self.read_ahead = read_ahead
        self.backend = resolve_backend(model, optimizer, lr_scheduler, backend, precision, backend_options)
        self.precision, self.world_size = self.backend.precision, self.backend.world_size
        self.callbacks: list[Callable[[StepInfo], None]] = []
        self.noise = None
        if noise_scale:
            from accum_sched.noise_tracking import NoiseTracking  # the noise scale's modules, only when measured

            self.noise = NoiseTracking(self.backend, adaptive, normalize=normalize, precision=self.precision)
        self.adaptive = None if self.noise is None else self.noise.adaptive
        self.factor_source = self.adaptive or self.schedule  # what decides each window's factor
        optimizer = getattr(self.backend, "optimizer", None)
        self.optimizer_rules = OptimizerRules(lr_coupling, co_scale, self.backend.param_groups(),
                                              "the optimizer" if optimizer is None else type(optimizer).__name__,
                                              self.factor_source.factor_at(0))

        # position and counters (all identical on every rank; state_dict holds them under these names)
        self.epoch_index = 0  # the epoch to run next (or running)
        self.micro_in_epoch = 0  # micro-batches of epoch_index already consumed (always at a window boundary)
        self.optimizer_steps = self.skipped_steps = 0
        self.overflow_steps = 0  # fp16 windows the GradScaler skipped (also in skipped_steps)
        self.micro_steps = 0  # micro-batches run on this rank
        self.elements = self.samples = 0  # over all ranks
        self.factor = self._factor_for()
        self.last_step: StepInfo | None = None
        self.stream_collectives = 0  # the small all-reduces that agree where streams end (none for sized loaders)
        self.should_stop = self._stop_requested = self._expect_backward = False
        self._rounds_offset = 0
        self._boundary = False  # the micro-batch handed out last ends its window
        self._filler = False  # the micro-batch handed out last is an EmptyMicroBatch's filler (zero weight)
        self._stream_short = False  # this rank lacks a micro-batch its stream read ahead at this boundary
        self._want_norm = False  # whether the open window's gradient norm is measured
        self._prescale = 1.0  # loss multiplier of the open window (see _window_prescale)
        self._prescale_size = 1  # ... and the window size it assumed (a stream's window may end short)
        self.window = OpenWindow()
        self._encode_stats = window_stats.HostEncoder()  # the window's numbers, into one vector kept across windows

        # stopping inside a window (see resume.py): needs a back end that can hand out its local gradients
        # (and no per-micro-batch state of its own outside the gradients: the noise scale's sums are not saved)
        partial_ok = self.backend.capabilities.stop_mid_window and self.noise is None
        self.stop_at = stop_at if partial_ok else "boundary"
        self._stop_poll = StopPoll.when(self.stop_at, self.world_size, stop_poll_every, stop_poll_min_ms)

    # -- public counters ----------------------------------------------------------------------------------------
    @property
    def allreduce_rounds(self) -> int | None:
        """Gradient all-reduce rounds so far, as counted by the back end (DDP comm hook); None if not counted."""
        rounds = self.backend.allreduce_rounds
        return None if rounds is None else rounds + self._rounds_offset

    @property
    def effective_batch(self) -> int | None:
        """Samples per optimizer step at the current factor (micro x factor x world), if the micro-batch is known."""
        return None if self.micro_batch_size is None else self.micro_batch_size * self.factor * self.world_size

    def on_step(self, callback: Callable[[StepInfo], None]) -> Callable[[StepInfo], None]:
        """Register ``callback(StepInfo)``, called on every rank after each optimizer step. Usable as a decorator."""
        self.callbacks.append(callback)
        return callback

    def request_stop(self) -> None:
        """Ask to stop (safe from a signal handler: it only sets a flag), at the next optimizer boundary or, with
        ``stop_at="micro_batch"``, within about one micro-batch. Ranks agree on it by collective, so every rank
        stops after the same micro-batch and :attr:`should_stop` becomes True everywhere. A stop inside a window
        leaves it open (:attr:`window_open`): save :meth:`state_dict` on every rank, it holds this rank's gradient.
        """
        self._stop_requested = True

    @property
    def window_open(self) -> bool:
        """True between micro-batches of an unfinished window, e.g. after a stop inside it."""
        return self.window.is_open

    def resume_offset(self, epoch: int) -> int:
        """Micro-batches of ``epoch`` already trained: where a positioned loader must start (0 unless resuming it).
        With a loader that starts there (e.g. over :class:`accum_sched.ResumeSampler`), pass ``skip=False`` to
        :meth:`micro_batches`: nothing before the resume point is loaded."""
        return self.micro_in_epoch if epoch == self.epoch_index else 0

    def _factor_for(self) -> int:
        """The factor of the window starting now: the adaptive controller's, or the schedule's."""
        if self.adaptive is None and self.schedule.unit == "epoch":  # the usual case, once per window
            return self.schedule.factor_at(self.epoch_index)
        # fp16 overflow steps took no optimizer step, so a step-keyed schedule does not count them (as the LR scheduler)
        return self.factor_source.factor_for(Position(epoch=self.epoch_index, samples=self.samples,
                                                      step=self.optimizer_steps - self.overflow_steps,
                                                      tokens=self.elements))

    # -- the loop -----------------------------------------------------------------------------------------------
    def autocast(self):
        """Context for the forward pass under the configured precision (a no-op for fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16  # CPU autocast takes float16 too
        return torch.autocast(device_type=module_device(self.model).type, dtype=dtype)

    def micro_batches(self, loader: Iterable, epoch: int | None = None, num_batches: int | None = None, *,
                      skip: bool = True) -> Iterator:
        """Yield the micro-batches of ``epoch``, each inside its gradient-sync context; call :meth:`backward` once for
        each before taking the next. The iteration ends early once :attr:`should_stop` turns True.

        ``loader`` may be a stream (no ``len()``): the epoch ends where the shortest rank's ends (``uneven='error'``
        raises instead), agreed as it comes (:class:`accum_sched.epoch_feed.StreamFeed`); ``num_batches``, where
        given, is the length. Resuming mid-epoch, the first :meth:`resume_offset` micro-batches were trained:
        ``skip=True`` (default) reads and drops them from a whole epoch; ``skip=False`` takes a loader positioned
        there already (its length counts only the rest).
        """
        epoch = self.epoch_index if epoch is None else epoch
        if epoch < self.epoch_index:
            raise ValueError(f"epoch {epoch} was already trained (the engine is at epoch {self.epoch_index})")
        if epoch > self.epoch_index:
            if self.window_open:
                raise RuntimeError(f"epoch {self.epoch_index} stopped inside a window; finish it before epoch {epoch}")
            self.epoch_index, self.micro_in_epoch = epoch, 0
        start = self.micro_in_epoch
        if num_batches is None and streams.has_length(loader):
            num_batches = len(loader)
        if num_batches is not None and not skip:
            num_batches += start  # the loader yields only what remains
        total = self._agree_epoch(epoch, num_batches, start)
        if total < 0:
            feed = epoch_feed.StreamFeed(loader, start, skip, epoch, uneven=self.uneven, read_ahead=self.read_ahead,
                                         count=self._count_stream_collectives)
        else:
            feed = epoch_feed.SizedFeed(loader, total, start, skip, num_batches, epoch)
        consumed = start if self.window.start is None else self.window.start  # a window left open goes on
        self.window.start = None
        try:
            while not feed.ended and not self.should_stop:
                factor = self._factor_for()
                size = factor if total < 0 else min(factor, total - consumed)  # a stream's: full until it ends
                self._open_window(factor, size)
                j = self.micro_in_epoch - consumed
                while j < size:
                    item = feed.next(j == size - 1)
                    if item is None:  # a stream ended on some rank (only at a window's start: the last was known)
                        break
                    batch, last = item
                    self._stream_short = feed.short  # rides in the window's numbers (accum_sched.streams)
                    boundary = last or j == size - 1
                    yield from self._micro_batch(batch, boundary)
                    if self._after_micro_batch(consumed, j, 0 if boundary else size - 1 - j):  # a stop inside
                        return
                    j += 1
                    if boundary:
                        break
                if j == 0:
                    break
                consumed += j
                feed.settle(self._finish_window(epoch, factor, j))  # should_stop: the window's numbers say
        finally:
            feed.close()
        self._end_epoch(epoch)

    def _count_stream_collectives(self, n: int) -> None:
        self.stream_collectives += n

    def _open_window(self, factor: int, size: int) -> None:
        """A window of ``factor`` begins (``size`` micro-batches as far as is known now)."""
        self.factor = factor
        self._prescale = self._window_prescale(size)
        self._prescale_size = size
        saved, self.window.saved_multiplier = self.window.saved_multiplier, None
        if saved and saved != self._prescale:  # a resumed open window: bring its gradients to this multiplier
            scale_gradients(self.backend.local_grad_tensors(), self._prescale / saved)

    def _micro_batch(self, batch, boundary: bool) -> Iterator:
        """Hand out one micro-batch inside its gradient-sync context; its backward must come before the next."""
        self._boundary = boundary
        # a rank's empty micro-batch (accum_sched.invariant) still runs forward and backward, on a filler sample
        # weighted zero: every rank launches the same collectives (DDP's all-reduce, FSDP2's gathers)
        self._filler = isinstance(batch, EmptyMicroBatch)
        if self._filler:
            batch = batch.filler
        with self.backend.sync_context(boundary):
            self._expect_backward = True
            self.window.samples += 0 if self._filler else epoch_feed.batch_size(batch)
            yield batch
            if self._expect_backward:
                raise RuntimeError("call engine.backward(loss_sum, n_elements) for every micro-batch "
                                   "before taking the next one")

    def _after_micro_batch(self, consumed: int, j: int, left: int) -> bool:
        """Count it and poll the stop flag (``left``: the window's micro-batches after it, :class:`StopPoll`): a stop
        leaves the window open (for state_dict()) and sets should_stop. Returns the poll's answer."""
        self.micro_in_epoch = consumed + j + 1
        stop = self._stop_poll is not None and self._stop_poll.poll(self._stop_requested, left)
        if stop:  # every rank stops here; the window stays open for state_dict()
            self.window.start = consumed
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
            {"accumulation factor": factor, "schedule fingerprint": self.factor_source.fingerprint(),
             "resume position": start, "micro-batches per epoch": -1 if num_batches is None else num_batches,
             "micro-batch size": self.micro_batch_size or 0},
            context=f"at the start of epoch {epoch}", allow=("micro-batches per epoch",))
        if num_batches is None:
            return -1
        return epoch_feed.agreed_length(ranges, num_batches, start, factor, epoch, self.uneven)

    def backward(self, loss_sum: torch.Tensor, n_elements) -> None:
        """Backward of one micro-batch. ``loss_sum`` is the SUM of per-element losses, ``n_elements`` their count.

        The sum is back-propagated (times one constant per window when ``micro_batch_size`` is known); the
        window's gradient is divided by the global element count once, at the boundary, which makes the step
        exactly that of one batch made of the whole window.
        """
        if not self._expect_backward:
            raise RuntimeError("engine.backward() must be called once per micro-batch from engine.micro_batches()")
        self._expect_backward = False
        if self._filler:  # an empty micro-batch's filler: an exactly zero gradient (a finite loss times 0), no elements
            loss_sum, n_elements = loss_sum * 0.0, 0
        n = n_elements.detach() if isinstance(n_elements, torch.Tensor) else n_elements
        self.window.add(loss_sum, n)  # kept where they are: nothing here waits for the device
        if self._boundary:
            self._send_window_stats(loss_sum.device)
        if self.normalize == "micro_batches":
            self.backend.backward(loss_sum if self._filler else loss_sum / n)
        elif self._prescale != 1.0:
            self.backend.backward(loss_sum * self._prescale)
        else:
            self.backend.backward(loss_sum)
        if self.noise is not None:
            self.noise.after_backward(n, self._prescale, self._boundary)
        self.micro_steps += 1

    @property
    def _averaging(self) -> int:
        """What the back end's gradient collective divides by: the world size for DDP's mean, else 1."""
        return self.world_size if self.backend.averages_over_world else 1

    def _window_prescale(self, size: int) -> float:
        """Loss multiplier for a window of ``size`` micro-batches: 1/(its global element count, if it is full).

        With ``micro_batch_size`` known (agreed at each epoch start), every loss is multiplied by a full window's
        share, so the collective already delivers the exact mean and the step skips a pass over the gradient (the
        correction, :meth:`_coefficient`, is exactly 1.0); a short micro-batch or token counts make it differ.
        """
        if (self.micro_batch_size is None or self.normalize != "elements"
                or not self.backend.capabilities.prescale):
            return 1.0
        return self._averaging / (self.micro_batch_size * size * self.world_size)

    def _send_window_stats(self, device: torch.device) -> None:
        """Hand the window's numbers to the back end before its last backward: the loss and element count of the
        last micro-batch are known before its backward, so they can travel inside that backward's gradient
        all-reduce (DDP) or in an all-reduce that overlaps it."""
        # measured where something needs it: clipping, fp16 overflow detection, the noise scale, the cadence
        self._want_norm = (self.max_grad_norm is not None or self.precision == "fp16" or self.noise is not None or (
            self.norm_every is not None and (self.optimizer_steps + 1) % self.norm_every == 0))
        window = self.window
        stats = self._encode_stats(window.elements, window.samples, window.loss_sum(), self._stop_requested,
                                   self.backend.stats_dtype, device, self._stream_short,
                                   0 if self._stop_poll is None else self._stop_poll.stamp())
        self.backend.send_window_stats(stats, self._want_norm)

    def train_epoch(self, loader: Iterable, loss_fn: Callable, epoch: int | None = None, *, skip: bool = True) -> None:
        """Run one epoch: ``loss_fn(model, batch) -> (loss_sum, n_elements)`` on every micro-batch (``skip``: see
        :meth:`micro_batches`)."""
        for batch in self.micro_batches(loader, epoch, skip=skip):
            with self.autocast():
                loss_sum, n = loss_fn(self.model, batch)
            self.backward(loss_sum, n)

    # -- the step -----------------------------------------------------------------------------------------------
    def _finish_window(self, epoch: int, factor: int, size: int) -> bool:
        """Step the window; returns whether some rank's stream lacked a micro-batch read ahead at its boundary."""
        totals = window_stats.read(self.backend, self._want_norm)
        if self._stop_poll is not None:  # its time floor, from the micro-batch times the numbers carried
            self._stop_poll.agree(totals.micro_us)
        skip, overflow, loss_scale = window_stats.verdict(totals, self.backend, self.nonfinite, epoch,
                                                          self.optimizer_steps + 1)
        coef = self._coefficient(size, totals.elements)
        grad_norm = None if totals.grad_norm is None else totals.grad_norm * coef
        noise = None
        if self.noise is not None:  # one all-reduce of four numbers (accum_sched.noise_scale); the norm is measured
            noise = self.noise.finish_window(grad_norm, coef, float(totals.elements), skip)
        rules = self.optimizer_rules
        lr_scale = rules.lr_scale(factor, None if noise is None else noise["noise_scale"], size,
                                  float(totals.elements))
        scale = rules.step_scale(factor, lr_scale)
        beta2, weight_decay = rules.reported(self.backend.param_groups(), scale)
        lr = self.backend.lr() * lr_scale
        # a back end with its own batch bookkeeping (DeepSpeed's GAS, global_samples); a no-op elsewhere
        self.backend.on_window(factor, size, totals.samples)
        step_kwargs = {} if scale == 1.0 else {"lr_scale": scale}
        self.backend.step(coef, self.max_grad_norm, totals.grad_norm, skip, **step_kwargs)
        elements = totals.elements
        info = StepInfo(epoch=epoch, step=self.optimizer_steps + 1, factor=factor, micro_batches=size,
                        elements=elements, samples=totals.samples, lr=lr, grad_norm=grad_norm,
                        loss=totals.loss / elements if elements else float("nan"), skipped=skip, loss_scale=loss_scale,
                        noise=noise, factor_reason=None if self.noise is None else self.noise.reason, beta2=beta2,
                        weight_decay=weight_decay)
        self.optimizer_steps += 1
        self.skipped_steps += int(skip)
        self.overflow_steps += int(overflow)
        self.elements += elements
        self.samples += totals.samples
        self.should_stop = totals.stop
        if self.noise is not None:  # the adaptive controller decides from all-reduced numbers only
            self.noise.after_step(self.optimizer_steps, noise, float(elements), size)
        self.window.close()
        self._report(info, overflow)
        return totals.stream_short

    def _coefficient(self, size: int, elements: int) -> float:
        """What the window's gradient, as the collective left it, must be multiplied by to be the large-batch mean."""
        if self.normalize == "micro_batches":
            return 1.0 / size
        if self._prescale != 1.0:  # already divided by the count of the window it assumed; correct for the real one
            return (self.micro_batch_size * self._prescale_size * self.world_size) / max(elements, 1)
        return self._averaging / max(elements, 1)

    def _report(self, info: StepInfo, overflow: bool) -> None:
        self.last_step = info
        if overflow:
            log.info("step %d skipped: fp16 overflow at loss scale %g", info.step, info.loss_scale)
        elif info.skipped and collective.rank() == 0:
            log.warning("step %d skipped: %s", info.step,
                        "no elements in the window" if info.elements == 0 else "non-finite loss or gradient")
        for callback in self.callbacks:
            callback(info)

    # -- resume -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position and counters, each under its attribute's name (:mod:`accum_sched.engine_state`), the same
        on every rank; taken between windows, or after a stop inside one, when it also holds this rank's open
        ``"window"`` (its gradients too): then save every rank's and give each rank its own back."""
        if self._expect_backward or (self.window_open and not self.should_stop):
            raise RuntimeError("engine.state_dict() inside a window: save from an on_step callback, between epochs, "
                               "or after a stop (should_stop)")
        return engine_state.save(self)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next :meth:`micro_batches` call skips what was already trained."""
        engine_state.load(self, state)
        self.factor = self._factor_for()
        self.should_stop = self._stop_requested = False

    def counters(self) -> dict:
        """Counters for summaries: steps, micro-batches, elements, samples, all-reduce rounds, factor, batch, polls."""
        return {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
                "overflow_steps": self.overflow_steps, "micro_batches": self.micro_steps, "elements": self.elements,
                "samples": self.samples, "allreduce_rounds": self.allreduce_rounds, "factor": self.factor,
                "stop_poll_every": None if self._stop_poll is None else self._stop_poll.interval,
                "effective_batch": self.effective_batch, "stream_collectives": self.stream_collectives}


def optimizer_steps(schedule, batches_per_epoch, epochs: int) -> int:
    """Exact optimizer steps for ``schedule`` (see :meth:`AccumulationSchedule.optimizer_steps`)."""
    return AccumulationSchedule(schedule).optimizer_steps(batches_per_epoch, epochs)


__all__ = ["AccumulationEngine", "StepInfo", "optimizer_steps"]
