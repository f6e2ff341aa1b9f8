"""FSDP2 rows of the benchmark: accum_sched's FSDP2 back end next to a hand-written FSDP2 accumulation loop, in both
gradient-sync modes.

Both shard the same way (every Linear, then the root; FSDP2's defaults otherwise). The hand-written loop is what a
careful FSDP2 user writes: ``set_requires_gradient_sync(boundary)`` before each forward (boundary mode) or never
(every micro-batch), the per-micro-batch mean divided by the window's size, ``optimizer.step()`` on the boundary.
It is exact on this workload (every micro-batch full, equal counts on every rank).

Collectives are counted where FSDP2 issues them, in ``torch.distributed.all_gather_single`` /
``reduce_scatter_single`` (its default comm path looks them up there at call time), plus ``all_reduce`` calls
(the engine's per-window stats and gradient-norm all-reduces, a few numbers each); bytes are those of the
all-gather outputs and reduce-scatter inputs. Rounds/bytes in the shared columns are the reduce-scatters.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from workload import Workload, build_model, make_optimizer, rank_data, sample_losses, windowed


def _count_collectives(rec) -> None:
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "bytes": 0, "rs_bytes": 0}

    def counting(fn, key, tensor_kw):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counts[key] += 1
            tensor = kwargs.get(tensor_kw, args[0] if args else None)
            if key != "all_reduce" and isinstance(tensor, torch.Tensor):
                nbytes = tensor.numel() * tensor.element_size()
                counts["bytes"] += nbytes
                counts["rs_bytes"] += nbytes if key == "reduce_scatter" else 0
            return fn(*args, **kwargs)
        return wrapper

    dist.all_gather_single = counting(dist.all_gather_single, "all_gather", "output_tensor")
    dist.reduce_scatter_single = counting(dist.reduce_scatter_single, "reduce_scatter", "input")
    dist.all_reduce = counting(dist.all_reduce, "all_reduce", "tensor")
    rec.counts = lambda: (counts["reduce_scatter"], counts["rs_bytes"])
    rec.collectives = lambda: dict(counts)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` under FSDP2 over every rank: every Linear, then the root (the process group is up)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _sharded(w: Workload):
    dist.init_process_group("gloo")
    return shard(build_model(w.model))


def _loader(w: Workload) -> DataLoader:
    x, y = rank_data(w, dist.get_rank())
    return DataLoader(TensorDataset(x, y), batch_size=w.micro, shuffle=False)


def _unsharded(w: Workload, model) -> torch.nn.Module:
    """A plain module with the trained weights (shards gathered), for the agreement column."""
    fresh = build_model(w.model)
    with torch.no_grad():
        for dst, src in zip(fresh.parameters(), model.parameters()):
            dst.copy_(src.full_tensor())
    return fresh


def run_fsdp_engine(w: Workload, rec, sync: str) -> torch.nn.Module:
    """accum_sched's FSDP2 back end: our boundaries and exact normalisation, FSDP2's sharding."""
    from accum_sched import AccumulationEngine

    model = _sharded(w)
    _count_collectives(rec)
    engine = AccumulationEngine(model, make_optimizer(w, model.parameters()), w.schedule(), micro_batch_size=w.micro,
                                gradient_sync=sync)
    engine.on_step(lambda info: rec.step())
    loader = _loader(w)
    for epoch in range(w.epochs):
        rec.epoch_start(epoch)
        for x, y in engine.micro_batches(loader, epoch):
            engine.backward(sample_losses(model, x, y).sum(), x.shape[0])
        rec.epoch_end(epoch)
    return _unsharded(w, model)


def run_fsdp_hand(w: Workload, rec, sync: str) -> torch.nn.Module:
    """A hand-written FSDP2 accumulation loop (see the module docstring)."""
    model = _sharded(w)
    _count_collectives(rec)
    optimizer = make_optimizer(w, model.parameters())
    loader = _loader(w)
    for epoch in range(w.epochs):
        rec.epoch_start(epoch)
        for (x, y), size, boundary in windowed(loader, w.factor_of_epoch(epoch)):
            if sync != "every_micro_batch":
                model.set_requires_gradient_sync(boundary)
            if sync == "boundary-keep":  # parameters stay gathered from the window's first forward to its last backward
                model.set_reshard_after_forward(boundary)
                model.set_reshard_after_backward(boundary)
            (sample_losses(model, x, y).mean() / size).backward()
            if boundary:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                rec.step()
        rec.epoch_end(epoch)
    return _unsharded(w, model)


def variants(variant_cls) -> dict:
    rows = {}
    for sync, short in (("boundary", "b"), ("every_micro_batch", "e")):
        rows[f"fsdp-{short}-hand"] = variant_cls(f"fsdp-{short}-hand", f"hand-written FSDP2 loop, {sync}",
                                                 functools.partial(run_fsdp_hand, sync=sync))
        rows[f"fsdp-{short}"] = variant_cls(f"fsdp-{short}", f"accum_sched + FSDP2, {sync}",
                                            functools.partial(run_fsdp_engine, sync=sync))
    # measured for the docs: boundary mode with parameters kept gathered inside the window (set_reshard_after_*)
    rows["fsdp-b-keep"] = variant_cls("fsdp-b-keep", "hand-written FSDP2 loop, boundary, kept gathered",
                                      functools.partial(run_fsdp_hand, sync="boundary-keep"))
    return rows
