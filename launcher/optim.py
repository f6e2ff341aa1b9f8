"""Optimizers and LR schedulers from the config. LR totals come from the schedule-aware optimizer-step count."""
from __future__ import annotations

import math

import torch


def build_optimizer(section, params):
    """``sgd``, ``adam`` or ``adamw`` with torch's own defaults for anything the config leaves out (SGD momentum 0)."""
    kwargs = {"lr": section.lr}
    if section.weight_decay is not None:
        kwargs["weight_decay"] = section.weight_decay
    if section.name == "sgd":
        if section.momentum is not None:
            kwargs["momentum"] = section.momentum
        return torch.optim.SGD(params, **kwargs)
    if section.betas is not None:
        kwargs["betas"] = tuple(section.betas)
    if section.eps is not None:
        kwargs["eps"] = section.eps
    return (torch.optim.Adam if section.name == "adam" else torch.optim.AdamW)(params, **kwargs)


def lr_multiplier(name: str, step: int, total: int, warmup: int, floor: float) -> float:
    """LR / base LR after ``step`` optimizer steps: linear warm-up, then constant, linear or cosine decay to floor."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if name == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if name == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def build_lr_scheduler(section, optimizer, total_steps: int):
    """None for a constant LR without warm-up; otherwise a scheduler stepped once per optimizer step."""
    if section is None:
        return None
    total = max(1, total_steps)
    if section.name == "onecycle":
        pct = min(0.99, max(section.warmup_steps / total, 1.0 / total)) if section.warmup_steps else 0.3
        max_lr = [g["lr"] for g in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total, pct_start=pct)
    base = optimizer.param_groups[0]["lr"]
    floor = min(1.0, section.min_lr / base) if base else 0.0
    name, warmup = section.name, section.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(name, s, total, warmup, floor))
