"""Tiny collectives the engine needs besides DDP's own gradient all-reduce.

Each is a single all-reduce of a handful of numbers. They run on the default process group, on the device that
group's backend needs (CUDA for NCCL, CPU otherwise). Being collectives, they also bound disagreement: every rank
calls them at the same point of the loop, so a rank that disagrees learns it there, in the same round as the others.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def comm_device() -> torch.device:
    """Where small collective tensors must live for the default group's backend."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a small float64 vector over ranks (in place when distributed); returns it."""
    if is_distributed():
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def all_sum_async(values: torch.Tensor, group=None):
    """Start summing ``values`` over ranks in place; returns the work to ``wait()`` on (None in one process)."""
    if is_distributed():
        return dist.all_reduce(values, op=dist.ReduceOp.SUM, async_op=True, group=group)
    return None


_side_group = None


def side_group():
    """A gloo group over all ranks for small CPU flags polled every micro-batch (the stop flag): it never queues
    behind the gradient collectives of the default group, and reading a CPU tensor is no device sync under NCCL.
    Made once, on first use; collective (every rank must ask at the same point, e.g. in the engine's constructor)."""
    global _side_group
    if _side_group is None:
        _side_group = dist.new_group(backend="gloo")
    return _side_group


def stats_group():
    """Where a back end sums its window's numbers when they cannot ride in the gradient collective (DeepSpeed, FSDP2,
    DDP without the engine's hook): under gloo, the side group, so that the small all-reduce runs beside the
    gradient collectives instead of queueing with them on the default group's one thread (measured: a small
    gloo all-reduce takes ~1.5 ms on a 2-core machine); under NCCL the default group (None), whose device tensors
    need no copy. Collective on first use: call it from a back end's constructor."""
    if not is_distributed() or comm_device().type != "cpu":
        return None
    return side_group()


def min_max(values: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per-entry (minimum, maximum) of integer ``values`` over ranks, in one all-reduce (MAX of v and -v)."""
    if not is_distributed():
        return list(values), list(values)
    t = torch.tensor(list(values) + [-v for v in values], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    n = len(values)
    got = t.tolist()
    return [-v for v in got[n:]], got[:n]


class RankDisagreement(RuntimeError):
    """Ranks hold different values for something they must share (factor, schedule, micro-batch count)."""


def agree(named: dict[str, int], *, context: str = "", allow: Sequence[str] = ()) -> dict[str, tuple[int, int]]:
    """Check that every rank holds the same integers; raise RankDisagreement on every rank otherwise.

    Names listed in ``allow`` may differ (the caller decides what to do with their range). Returns
    ``{name: (min, max)}``. One all-reduce, so all ranks reach the same verdict at the same point.
    """
    names = list(named)
    lows, highs = min_max([int(named[k]) for k in names])
    ranges = {k: (lo, hi) for k, lo, hi in zip(names, lows, highs)}
    bad = [k for k in names if k not in allow and ranges[k][0] != ranges[k][1]]
    if bad:
        where = f" {context}" if context else ""
        detail = "; ".join(f"{k}: this rank {named[k]}, ranks range {ranges[k][0]}..{ranges[k][1]}" for k in bad)
        raise RankDisagreement(f"rank {rank()} of {world_size()}: ranks disagree{where} on {detail}. "
                               f"Every rank must use the same accumulation schedule and data length.")
    return ranges
