"""DeepSpeed rows of the benchmark: accum_sched driving DeepSpeed (ZeRO 0 and 2) next to DeepSpeed alone.

"DeepSpeed alone" is what a DeepSpeed user does today without us: a fixed gradient_accumulation_steps for each
epoch's factor (set with set_train_batch_size at the epoch start), mean losses, engine.step() after every
micro-batch. It divides every window by the configured GAS and lets boundaries fall where its global micro-step
counter says, so it is not exact; the agreement column shows by how much.

Collectives are counted where DeepSpeed issues them, in the `deepspeed.comm` module its ZeRO code calls through:
every call and the bytes of its tensor argument, per optimizer step. Our engine's one small stats all-reduce goes
through torch.distributed directly and is not in these counts (the DDP rows do not count it either).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from workload import Workload, build_model, make_optimizer, rank_data, sample_losses

# deepspeed.comm functions that move gradient (or parameter) data during training
COUNTED = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter_fn", "all_gather_into_tensor",
           "allgather_fn", "all_reduce_coalesced", "broadcast")


def _count_collectives(rec) -> None:
    import deepspeed.comm as ds_comm

    counts = {"calls": 0, "bytes": 0}

    def counting(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            counts["calls"] += 1
            counts["bytes"] += tensors[0].numel() * tensors[0].element_size() if tensors else 0
            return fn(*args, **kwargs)
        return wrapper

    for name in COUNTED:
        if hasattr(ds_comm, name):
            setattr(ds_comm, name, counting(getattr(ds_comm, name)))
    rec.counts = lambda: (counts["calls"], counts["bytes"])


def _initialize(w: Workload, stage: int, gas: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

    ensure_torch_extensions_dir()
    import deepspeed

    dist.init_process_group("gloo")
    model = build_model(w.model)
    config = {"train_micro_batch_size_per_gpu": w.micro, "gradient_accumulation_steps": gas,
              "train_batch_size": w.micro * gas * w.world, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1}
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(w, model.parameters()), config=config)
    return model, ds_engine


def _loader(w: Workload) -> DataLoader:
    x, y = rank_data(w, dist.get_rank())
    return DataLoader(TensorDataset(x, y), batch_size=w.micro, shuffle=False)


def run_deepspeed_engine(w: Workload, rec, stage: int) -> torch.nn.Module:
    """accum_sched's DeepSpeed back end: our boundaries and exact normalisation, DeepSpeed's ZeRO."""
    from accum_sched import AccumulationEngine
    from accum_sched.backends.deepspeed import consolidated_state_dict

    _, ds_engine = _initialize(w, stage, w.factor_of_epoch(0))
    _count_collectives(rec)
    engine = AccumulationEngine(ds_engine, None, w.schedule(), micro_batch_size=w.micro)
    engine.on_step(lambda info: rec.step())
    loader = _loader(w)
    for epoch in range(w.epochs):
        rec.epoch_start(epoch)
        for x, y in engine.micro_batches(loader, epoch):
            engine.backward(sample_losses(ds_engine, x, y).sum(), x.shape[0])
        rec.epoch_end(epoch)
    return _as_module(w, consolidated_state_dict(ds_engine, rank0_only=False))


def run_deepspeed_alone(w: Workload, rec, stage: int) -> torch.nn.Module:
    """DeepSpeed by itself: set_train_batch_size per epoch, mean losses, step() every micro-batch."""
    from accum_sched.backends.deepspeed import consolidated_state_dict

    _, ds_engine = _initialize(w, stage, w.factor_of_epoch(0))
    _count_collectives(rec)
    loader = _loader(w)
    for epoch in range(w.epochs):
        ds_engine.set_train_batch_size(w.micro * w.factor_of_epoch(epoch) * w.world)
        rec.epoch_start(epoch)
        for x, y in loader:
            ds_engine.backward(sample_losses(ds_engine, x, y).mean())
            boundary = ds_engine.is_gradient_accumulation_boundary()
            ds_engine.step()
            if boundary:
                rec.step()
        rec.epoch_end(epoch)
    return _as_module(w, consolidated_state_dict(ds_engine, rank0_only=False))


def _as_module(w: Workload, state: dict) -> torch.nn.Module:
    """A plain fp32 module with the trained weights (ZeRO partitions gathered), for the agreement column."""
    fresh = build_model(w.model)
    fresh.load_state_dict(state)
    return fresh


def variants(variant_cls) -> dict:
    rows = {}
    for stage in (0, 2):
        rows[f"ds{stage}"] = variant_cls(f"ds{stage}", f"accum_sched + DeepSpeed ZeRO-{stage}",
                                         functools.partial(run_deepspeed_engine, stage=stage), requires=("deepspeed",))
        rows[f"ds{stage}-alone"] = variant_cls(
            f"ds{stage}-alone", f"DeepSpeed ZeRO-{stage} alone, GAS per epoch",
            functools.partial(run_deepspeed_alone, stage=stage), requires=("deepspeed",), exact=False,
            note="divides every window by its GAS; boundaries follow its global counter")
    return rows
