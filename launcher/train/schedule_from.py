"""``accumulation.schedule_from``: the converted schedule and its LR per step, for the worker and `accum-sched plan`.

The reference LR multipliers come from the configured LR scheduler itself, stepped on a throw-away optimizer over
the reference run's steps (one per micro-batch at factor 1), so a built-in or an import-path scheduler converts the
same way. The conversion is accum_sched.schedule_from's.
"""
from __future__ import annotations

import math

from accum_sched import schedule_from
from launcher.config import Config
from launcher.errors import ConfigError


def batches_per_rank(samples: int, world: int, micro: int, drop_last: bool) -> tuple[int, int]:
    """(samples per rank, micro-batches per rank per epoch) under DistributedSampler (padded to equal length)."""
    per_rank = math.ceil(samples / world)
    return per_rank, (per_rank // micro if drop_last else math.ceil(per_rank / micro))


def reference_multipliers(cfg: Config, steps: int) -> list[float]:
    """LR / base LR of each of ``steps`` reference steps under ``cfg.lr_scheduler``."""
    import torch  # `accum-sched plan` loads this module on login nodes

    from launcher.train.optim import build_lr_scheduler  # imports torch, as above

    base = cfg.optimizer.lr
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = build_lr_scheduler(cfg.lr_scheduler, optimizer, steps)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"] / base)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return out


def convert(cfg: Config, samples: int, world: int) -> schedule_from.Converted:
    """The converted run of ``cfg`` over a map-style dataset of ``samples`` samples on ``world`` ranks."""
    acc, micro = cfg.accumulation, cfg.data.micro_batch_size
    per_rank, batches = batches_per_rank(samples, world, micro, cfg.data.drop_last)
    per_epoch = [batches] * cfg.run.epochs
    try:
        return schedule_from.convert(
            acc.schedule_from, reference_multipliers(cfg, sum(per_epoch)), per_epoch, acc.unit,
            samples_per_micro_step=lambda e, i: world * min(micro, per_rank - i * micro),
            max_steps=cfg.run.max_steps)
    except ValueError as exc:
        raise ConfigError("accumulation.schedule_from", str(exc), "see docs/batch-size.md") from None


def lr_scheduler(converted: schedule_from.Converted, optimizer):
    """A LambdaLR giving step j the converted run's LR multiplier (held at the last one past the end)."""
    # torch: `accum-sched plan` loads this module on login nodes
    import torch

    table, last = converted.lr, len(converted.lr) - 1
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda j: table[min(j, last)])


def describe(converted: schedule_from.Converted, base_lr: float, micro: int, world: int) -> list[str]:
    """The plan as lines: step range, factor, effective batch, LR at its first and last step."""
    lines = [f"{'steps':>15}  {'factor':>6}  {'eff.batch':>9}  lr"]
    for first, last, factor, lr0, lr1 in schedule_from.ranges(converted):
        lr = f"{base_lr * lr0:.4g}" if lr0 == lr1 else f"{base_lr * lr0:.4g} -> {base_lr * lr1:.4g}"
        lines.append(f"{f'{first}-{last}':>15}  {factor:>6}  {factor * micro * world:>9}  {lr}")
    lines.append(f"{converted.total_steps} optimizer steps; schedule ({converted.schedule.unit}) "
                 f"{converted.schedule.to_dict()}")
    return lines
