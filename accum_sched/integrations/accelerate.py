"""Keep an Accelerate loop and get this project's exact windows: :func:`make_engine`.

Accelerate's ``accumulate()`` takes one ``gradient_accumulation_steps``; mutated per epoch, it still divides every
micro-batch's loss by the configured factor, so a partial window takes too small a step, and its prepared LR
scheduler steps once per process per optimizer step. Here the objects ``accelerator.prepare`` returned are handed to
an :class:`~accum_sched.AccumulationEngine`, and the loop is the engine's::

    model, optimizer, loader, lr_sched = accelerator.prepare(model, optimizer, loader, lr_sched)
    engine = make_engine(accelerator, model, optimizer, {6: 2, 11: 4}, lr_scheduler=lr_sched)
    for epoch in range(epochs):
        for batch in engine.micro_batches(loader, epoch):    # no_sync() off the boundary, as the engine decides
            loss_sum, n = ...                               # SUM of element losses, and how many elements
            engine.backward(loss_sum, n)                    # not accelerator.backward; no optimizer.step()

What is unwrapped: the torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (the engine steps, clips and
clears it), the scheduler inside ``AcceleratedScheduler`` (stepped once per optimizer step, so its total is
``schedule.optimizer_steps(len(loader), epochs)``), and nothing of the model: the DDP wrapper, the FSDP2 module
or the DeepSpeed engine ``prepare`` made is what the engine drives. Mixed precision is the accelerator's: its
prepared forward runs under autocast (except fp16 on CPU: there Accelerate neither autocasts nor scales, so the
forward goes under ``engine.autocast()``); with ``fp16`` the engine steps the accelerator's GradScaler, or one
built from its ``GradScalerKwargs``.
"""
from __future__ import annotations

from typing import Any

import torch

from accum_sched.engine import AccumulationEngine

# Accelerate's mixed_precision -> the engine's precision ("fp8" has no engine counterpart)
PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _inner(obj, attribute: str):
    """The torch object an Accelerate wrapper holds (``AcceleratedOptimizer.optimizer``,
    ``AcceleratedScheduler.scheduler``), or the object itself."""
    inner = getattr(obj, attribute, None)
    return obj if inner is None or type(obj).__module__.split(".")[0] != "accelerate" else inner


def make_engine(accelerator, model, optimizer, schedule: Any, lr_scheduler=None, **engine_kwargs
                ) -> AccumulationEngine:
    """An :class:`~accum_sched.AccumulationEngine` on what ``accelerator.prepare`` returned.

    Args:
        accelerator: the ``accelerate.Accelerator`` (DDP, FSDP2 with ``fsdp_version=2``, or its DeepSpeed plugin);
            its ``gradient_accumulation_steps`` must stay 1 (the schedule is the factor).
        model, optimizer: as ``prepare`` returned them (for DeepSpeed, the optimizer lives in the DeepSpeed engine).
        schedule: anything :class:`~accum_sched.AccumulationSchedule` accepts.
        lr_scheduler: a prepared (or plain) torch LR scheduler, stepped once per optimizer step.
        **engine_kwargs: passed to the engine (``max_grad_norm``, ``normalize``, ...); ``precision`` defaults to the
            accelerator's mixed precision.
    """
    steps = getattr(accelerator, "gradient_accumulation_steps", 1)
    if steps != 1:
        raise ValueError(f"Accelerator(gradient_accumulation_steps={steps}) and make_engine(schedule=...) both set "
                         f"the factor: leave gradient_accumulation_steps at 1 and give the factor in the schedule")
    deepspeed = type(model).__name__ == "DeepSpeedEngine"
    if "precision" not in engine_kwargs:
        engine_kwargs["precision"] = _deepspeed_precision(model) if deepspeed else _precision(accelerator)
    optimizer = _inner(optimizer, "optimizer")
    lr_scheduler = _inner(lr_scheduler, "scheduler")
    if deepspeed:  # it owns its optimizer, and steps the scheduler it was given
        optimizer = None
        if lr_scheduler is not None and getattr(model, "lr_scheduler", None) is not None:
            lr_scheduler = None
    engine = AccumulationEngine(model, optimizer, schedule, lr_scheduler=lr_scheduler, **engine_kwargs)
    _use_accelerator_scaler(accelerator, engine)
    return engine


def _precision(accelerator) -> str:
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    if mixed not in PRECISION:
        raise ValueError(f"Accelerator(mixed_precision={mixed!r}) is not supported by the engine; use one of "
                         f"{', '.join(PRECISION)}")
    return PRECISION[mixed]


def _deepspeed_precision(ds_engine) -> str:
    """Under DeepSpeed, Accelerate reports mixed_precision "no" and writes fp16/bf16 into DeepSpeed's config: the
    engine follows that config (DeepSpeed casts the weights; its own loss scaler serves fp16)."""
    return "fp16" if ds_engine.fp16_enabled() else "bf16" if ds_engine.bfloat16_enabled() else "fp32"


def _use_accelerator_scaler(accelerator, engine: AccumulationEngine) -> None:
    """fp16 with a torch GradScaler: the engine steps the accelerator's scaler where Accelerate made one (so
    ``accelerator.save_state`` saves the scale in use), else one built from the accelerator's ``GradScalerKwargs``
    (on CPU Accelerate 1.16 makes no scaler for fp16, its ``native_amp`` stays off)."""
    backend = engine.backend
    if engine.precision != "fp16" or getattr(backend, "scaler", None) is None:
        return  # no fp16, or a back end with its own loss scaling (DeepSpeed)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None:
        handler = getattr(accelerator, "scaler_handler", None)
        kwargs = handler.to_kwargs() if handler is not None else {}
        scaler = torch.amp.GradScaler(accelerator.device.type, **kwargs)
    backend.scaler = scaler


__all__ = ["PRECISION", "make_engine"]
