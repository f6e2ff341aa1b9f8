"""Keep a Lightning ``Trainer`` and get this project's exact windows: :class:`ScheduledAccumulation` (a callback)
plus :class:`AccumulationMixin` (a LightningModule mixin that uses manual optimization).

Lightning's own ``GradientAccumulationScheduler`` divides every micro-batch's loss by the configured factor, so the
last, partial window of an epoch takes too small a step, and ``estimated_stepping_batches`` ignores the schedule.
Here the :class:`~accum_sched.AccumulationEngine` owns the windows instead:

* ``on_train_batch_start`` (which Lightning runs before ``training_step``, hence before the DDP-wrapped forward)
  advances the engine's ``micro_batches()`` generator by one, fed the batch Lightning just produced: off a window's
  boundary the forward and the backward run inside DDP's ``no_sync()``;
* ``training_step`` (the mixin's) hands the loss SUM and its element count to ``engine.backward``; the engine divides
  by the window's global count at the boundary, partial windows included, and steps the optimizer and the LR
  scheduler itself;
* the epoch's length is Lightning's ``num_training_batches`` (per rank), so the last window is stepped at its real
  size at the epoch's end.

A window's optimizer step runs when the generator is next advanced: at the start of the next micro-batch, or at the
end of the epoch's last one. Lightning's ``trainer.global_step`` does not count these steps (they bypass
``LightningOptimizer``); read ``engine.optimizer_steps``. fp32 and bf16 only here (the engine's autocast); fp16
and Lightning's precision plugins are not wired in.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from accum_sched.schedule import AccumulationSchedule

_END = object()


class _Feed:
    """An iterator the engine reads micro-batches from: one slot, filled by the callback with Lightning's batch."""

    def __init__(self):
        self._batch = _END

    def put(self, batch) -> None:
        self._batch = batch

    def __iter__(self):
        return self

    def __next__(self):
        batch, self._batch = self._batch, _END
        if batch is _END:
            raise RuntimeError("accum_sched: the engine asked for a micro-batch Lightning has not produced")
        return batch


class ScheduledAccumulation(pl.Callback):
    """Drive an :class:`~accum_sched.AccumulationEngine` from Lightning's training loop.

    Args:
        schedule: anything :class:`~accum_sched.AccumulationSchedule` accepts (epoch unit: Lightning's semantics).
        **engine_kwargs: passed to the engine (``max_grad_norm``, ``precision="bf16"``, ``normalize``, ...).

    The engine is built at ``on_train_start`` from ``trainer.strategy.model`` (the DDP wrapper under DDP),
    ``trainer.optimizers[0]`` and the first LR scheduler of ``configure_optimizers``, which it steps once per
    optimizer step (give it :meth:`AccumulationMixin.accumulation_total_steps` as its total).
    """

    def __init__(self, schedule: Any = 1, **engine_kwargs):
        self.schedule = AccumulationSchedule(schedule)
        self.engine_kwargs = engine_kwargs
        self.engine = None
        self._feed = _Feed()
        self._batches = None
        self._num_batches = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and pl_module.automatic_optimization:
            raise ValueError("ScheduledAccumulation needs manual optimization: mix AccumulationMixin into the "
                             "LightningModule (or set automatic_optimization = False and call engine.backward)")
        if stage == "fit" and trainer.accumulate_grad_batches != 1:
            raise ValueError("give the schedule to ScheduledAccumulation, not Trainer(accumulate_grad_batches=...)")
        pl_module.accumulation = self

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from accum_sched.engine import AccumulationEngine

        if len(trainer.optimizers) != 1:
            raise ValueError(f"ScheduledAccumulation steps one optimizer; configure_optimizers gave "
                             f"{len(trainer.optimizers)}")
        configs = trainer.lr_scheduler_configs
        if len(configs) > 1 or (configs and configs[0].interval != "step"):
            raise ValueError("ScheduledAccumulation steps at most one LR scheduler, once per optimizer step: "
                             "return it with interval='step'")
        lr_scheduler = configs[0].scheduler if configs else None
        self.engine = AccumulationEngine(trainer.strategy.model, trainer.optimizers[0], self.schedule,
                                         lr_scheduler=lr_scheduler, **self.engine_kwargs)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # DistributedSampler pads the ranks to one length, and the engine agrees on it by collective anyway
        self._num_batches = int(trainer.num_training_batches)
        self._batches = self.engine.micro_batches(self._feed, trainer.current_epoch, num_batches=self._num_batches)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        # runs before training_step, i.e. before DDP's forward, which decides whether the backward all-reduces:
        # the generator steps the previous window if it ended, then enters this micro-batch's sync context
        self._feed.put(batch)
        next(self._batches)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if batch_idx == self._num_batches - 1:  # the epoch's last window is stepped now, at its real size
            if next(self._batches, _END) is not _END:
                raise RuntimeError("accum_sched: the engine expected more micro-batches than Lightning produced")
            self._batches = None

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (Lightning's ``global_step`` does not see them)."""
        return 0 if self.engine is None else self.engine.optimizer_steps


class AccumulationMixin:
    """Mix into a LightningModule before ``LightningModule``: ``class M(AccumulationMixin, pl.LightningModule)``.

    Implement ``accumulation_loss(batch, batch_idx) -> (loss_sum, n_elements)``: the SUM of per-element losses of
    the micro-batch and how many elements (samples, or real tokens) it covers. The mixin's ``training_step`` hands
    them to the engine; do not call ``optimizer.step()``, ``zero_grad`` or ``manual_backward`` yourself.
    """

    @property
    def automatic_optimization(self) -> bool:
        return False

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        if value:
            raise ValueError("AccumulationMixin uses manual optimization: the engine steps the optimizer")

    def accumulation_loss(self, batch, batch_idx: int):
        raise NotImplementedError("return (loss_sum, n_elements) for this micro-batch")

    def training_step(self, batch, batch_idx: int):
        engine = self.accumulation.engine
        with engine.autocast():
            loss_sum, n = self.accumulation_loss(batch, batch_idx)
        # the backward runs inside DDP's forward (Lightning redirects the DDP-wrapped forward to training_step), so
        # DDP has not prepared its reducer yet: the strategy's pre_backward does that (as manual_backward would)
        strategy = self.trainer.strategy
        strategy.pre_backward(loss_sum)
        engine.backward(loss_sum, n)
        strategy.post_backward(loss_sum)
        return loss_sum.detach()

    def accumulation_total_steps(self) -> int:
        """Exact optimizer steps of the whole fit (``max_epochs`` epochs of the schedule), for an LR scheduler's
        total; callable from ``configure_optimizers``."""
        return total_steps(self.trainer, self.accumulation.schedule)


def total_steps(trainer: pl.Trainer, schedule: Any) -> int:
    """Exact optimizer steps of ``trainer``'s fit under ``schedule`` (Lightning's ``estimated_stepping_batches``
    divides by one factor; this sums ceil(batches / factor) epoch by epoch)."""
    if trainer.max_epochs is None or trainer.max_epochs < 0:
        raise ValueError("a schedule-aware step total needs Trainer(max_epochs=...)")
    trainer.fit_loop.setup_data()  # what estimated_stepping_batches does too: the loader's length per rank
    batches = trainer.num_training_batches
    if batches == float("inf"):
        raise ValueError("a schedule-aware step total needs a train loader with len()")
    return AccumulationSchedule(schedule).optimizer_steps(int(batches), trainer.max_epochs)


__all__ = ["AccumulationMixin", "ScheduledAccumulation", "total_steps"]
