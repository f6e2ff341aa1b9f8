"""One evaluation pass: the exact mean loss (and metrics) over every element of a validation set, on every rank.

Each rank takes the samples ``rank, rank + world, ...`` (no DistributedSampler: its padding repeats samples, which
would then count twice), sums ``loss_fn``'s (loss sum, elements) and ``metrics_fn``'s (sum, count) pairs in float64,
and one all-reduce adds them over ranks, so every rank holds the same numbers and reaches the same decisions.

Training must not notice: the pass runs under ``torch.no_grad()`` with every submodule in eval mode (each put back to
its own mode afterwards) and inside a fork of the RNGs (torch CPU and CUDA, Python, NumPy), so dropout in the
training that follows draws what it would have drawn without the evaluation.

A stream (an ``IterableDataset``) is already one rank's share (the launcher shards it as for training, by
``data.shard``): each rank reads its own to the end, and one small all-reduce per batch (how many ranks still have
one) keeps the forward counts equal, the ranks whose share ended running filler forwards until all have.

Any wrapper whose forward is callable works. DDP is unwrapped (its replicas are identical and its forward would
broadcast buffers); a forward that communicates (FSDP2 all-gathers, DeepSpeed ZeRO-3) needs every rank to make the
same number of calls, so a rank whose shard is one batch short runs a discarded forward on a filler batch.
"""
from __future__ import annotations

import contextlib
import math
import random
import zlib

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset, Subset, default_collate

from accum_sched import collective

try:  # its RNG is forked around evaluation where it is installed (torch does not need it)
    import numpy as np
except ImportError:
    np = None


def shard(n: int, rank: int, world: int) -> range:
    """This rank's sample indices: every world-th one, so each sample is on exactly one rank."""
    return range(rank, n, world)


def batches_per_rank(n: int, world: int, micro: int) -> int:
    """Forward calls every rank makes: those of the largest shard."""
    return math.ceil(math.ceil(n / world) / micro) if n else 0


def unwrap(model):
    """The module to run: DDP's inner module (identical on every rank, no collective in its forward), otherwise the
    model as given (DeepSpeed engine, FSDP2 module, plain module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def quiet_eval(model: torch.nn.Module, device: torch.device | None = None):
    """no_grad, eval mode and forked RNGs; every module's own training flag and every RNG restored on exit."""
    modes = [(m, m.training) for m in model.modules()]
    py_state = random.getstate()
    np_state = None if np is None else np.random.get_state()
    cuda = device is not None and device.type == "cuda"
    try:
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"), torch.no_grad():
            model.eval()
            yield
    finally:
        for module, training in modes:
            module.training = training
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)


def _rounds(dataset, micro: int, collate):
    """This rank's batches, then None while other ranks still have some: as many items on every rank."""
    rank, world = collective.rank(), collective.world_size()
    if not isinstance(dataset, IterableDataset):
        n = len(dataset)
        loader = DataLoader(Subset(dataset, shard(n, rank, world)), batch_size=micro, shuffle=False,
                            collate_fn=collate)
        batches = iter(loader)
        for _ in range(batches_per_rank(n, world, micro)):
            yield next(batches, None)
        return
    batches = iter(DataLoader(dataset, batch_size=micro, collate_fn=collate))
    while True:
        batch = next(batches, None)
        if world > 1:  # how many ranks have a batch this round (blocking: evaluation is not the hot loop)
            have = torch.tensor([float(batch is not None)], device=collective.comm_device())
            collective.all_sum(have)
            if have.item() == 0:
                return
        elif batch is None:
            return
        yield batch


def _filler(dataset, collate):
    """A batch to run (and discard) where this rank's share is short: its first sample, or a stream's first."""
    if not isinstance(dataset, IterableDataset):
        return collate([dataset[0]])
    for source in (dataset, getattr(dataset, "dataset", dataset)):  # a launcher ShardedStream wraps the task's
        for sample in source:
            return collate([sample])
    raise ValueError("the validation stream is empty on every shard; no batch to evaluate")


def _as_float64(value, device) -> torch.Tensor:
    return torch.as_tensor(value).detach().to(device=device, dtype=torch.float64).reshape(())


def evaluate(model, dataset, loss_fn, *, micro_batch_size: int, collate_fn=None, metrics_fn=None,
             move=None, autocast=None, device: torch.device | None = None) -> dict:
    """``{"val_loss", "val_elements", <metric>...}`` over the whole of ``dataset``, identical on every rank.

    ``loss_fn(model, batch) -> (loss_sum, n)`` and ``metrics_fn(model, batch) -> {name: (sum, count)}`` as in
    training; ``move(batch)`` puts a batch on the device; ``autocast()`` the training precision's context.
    Collective: call on every rank at the same point.
    """
    move = move or (lambda b: b)
    autocast = autocast or contextlib.nullcontext
    where = device or torch.device("cpu")
    net = unwrap(model)
    loss_total = torch.zeros((), dtype=torch.float64, device=where)
    count_total = torch.zeros((), dtype=torch.float64, device=where)
    metric_sums: dict[str, list[torch.Tensor]] = {}
    filler = None
    with quiet_eval(net, device):
        for batch in _rounds(dataset, micro_batch_size, collate_fn or default_collate):
            real = batch is not None
            if not real:  # this shard is a batch short: same forward count as the others, nothing counted
                if filler is None:
                    filler = _filler(dataset, collate_fn or default_collate)
                batch = filler
            batch = move(batch)
            with autocast():
                loss_sum, count = loss_fn(net, batch)
                metrics = metrics_fn(net, batch) if metrics_fn is not None else {}
            if not real:
                for name in metrics:
                    metric_sums.setdefault(name, [torch.zeros((), dtype=torch.float64, device=where)] * 2)
                continue
            loss_total += _as_float64(loss_sum, where)
            count_total += _as_float64(count, where)
            for name, (value, weight) in metrics.items():
                acc = metric_sums.setdefault(name, [torch.zeros((), dtype=torch.float64, device=where)] * 2)
                acc[0] = acc[0] + _as_float64(value, where)
                acc[1] = acc[1] + _as_float64(weight, where)
    rank, world = collective.rank(), collective.world_size()
    names = sorted(metric_sums)
    if "val_loss" in names or "val_elements" in names:
        raise ValueError("metrics_fn returned a metric named val_loss or val_elements; rename it")
    # One all-reduce: loss, elements, each metric's (sum, count), and a fingerprint of the metric names (equal on
    # every rank exactly when the sum is world x this rank's).
    fingerprint = float(zlib.crc32(",".join(names).encode()))
    packed = torch.stack([loss_total, count_total] + [t for name in names for t in metric_sums[name]]
                         + [torch.tensor(fingerprint, dtype=torch.float64, device=where)])
    packed = packed.to(collective.comm_device())
    collective.all_sum(packed)
    values = packed.tolist()
    if values[-1] != fingerprint * world:
        raise collective.RankDisagreement(f"rank {rank}: metrics_fn returned other metric names on other ranks "
                                          f"(this rank: {names})")
    out = {"val_loss": values[0] / values[1] if values[1] else float("nan"), "val_elements": int(round(values[1]))}
    for i, name in enumerate(names):
        total, weight = values[2 + 2 * i], values[3 + 2 * i]
        out[name] = total / weight if weight else float("nan")
    return out
