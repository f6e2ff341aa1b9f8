"""The training loops compared by the benchmark, one function each, registered in VARIANTS.

Each runs on every rank (started by torchrun), trains ``Workload`` and reports through the ``Recorder``:
``rec.epoch_start(e)`` / ``rec.epoch_end(e)`` around every epoch, ``rec.step()`` after every optimizer step, and
``rec.counts`` a callable giving (gradient all-reduce rounds, bytes) so far. It returns the trained module, whose
parameters are compared with the plain-torch reference. Gradient rounds are counted by the same DDP comm hook for
every DDP-based variant (accum_sched.backends.counting.counting_allreduce), so the counts are comparable.

Adding a variant (the DeepSpeed rows are meant to arrive this way):
    1. write ``def run_x(w: Workload, rec: Recorder) -> torch.nn.Module`` below;
    2. register ``Variant("x", "label", run_x, requires=("deepspeed",), exact=True)`` in VARIANTS.
A variant whose ``requires`` cannot be imported is skipped by bench/run.py with the reason in the table.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from workload import Workload, build_model, make_optimizer, rank_data, sample_losses, windowed


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    run: Callable  # (Workload, Recorder) -> torch.nn.Module, on every rank
    requires: tuple = ()  # modules that must be importable, else the row is skipped with the reason
    exact: bool = True  # should end allclose to the large-batch reference
    note: str = ""


def _ddp(w: Workload, rec) -> tuple[torch.nn.Module, DDP]:
    from accum_sched.backends.counting import CountingState, counting_allreduce

    dist.init_process_group("gloo")
    model = build_model(w.model)
    ddp = DDP(model)
    counter = CountingState()
    ddp.register_comm_hook(counter, counting_allreduce)
    rec.counts = lambda: (counter.rounds, counter.bytes)
    return model, ddp


def _loader(w: Workload) -> DataLoader:
    x, y = rank_data(w, dist.get_rank())
    return DataLoader(TensorDataset(x, y), batch_size=w.micro, shuffle=False)


def run_engine(w: Workload, rec) -> torch.nn.Module:
    """This project: the engine decides boundaries, no_sync and the exact normalisation."""
    from accum_sched import AccumulationEngine

    dist.init_process_group("gloo")
    model = build_model(w.model)
    engine = AccumulationEngine(DDP(model), make_optimizer(w, model.parameters()), w.schedule(),
                                micro_batch_size=w.micro)
    rec.counts = lambda: (engine.allreduce_rounds, engine.backend.allreduce_bytes)
    engine.on_step(lambda info: rec.step())
    loader = _loader(w)
    for epoch in range(w.epochs):
        rec.epoch_start(epoch)
        for x, y in engine.micro_batches(loader, epoch):
            engine.backward(sample_losses(engine.model, x, y).sum(), x.shape[0])
        rec.epoch_end(epoch)
    return model


def _hand_written(w: Workload, rec, use_no_sync: bool) -> torch.nn.Module:
    """What a careful person writes by hand: no_sync off the boundary, partial windows divided by their size."""
    model, ddp = _ddp(w, rec)
    optimizer = make_optimizer(w, model.parameters())
    loader = _loader(w)
    for epoch in range(w.epochs):
        rec.epoch_start(epoch)
        for (x, y), size, boundary in windowed(loader, w.factor_of_epoch(epoch)):
            local = use_no_sync and not boundary
            with ddp.no_sync() if local else contextlib.nullcontext():
                (sample_losses(ddp, x, y).mean() / size).backward()
            if boundary:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                rec.step()
        rec.epoch_end(epoch)
    return model


def run_no_sync(w: Workload, rec) -> torch.nn.Module:
    return _hand_written(w, rec, use_no_sync=True)


def run_every_micro_batch(w: Workload, rec) -> torch.nn.Module:
    return _hand_written(w, rec, use_no_sync=False)


def run_lightning(w: Workload, rec) -> torch.nn.Module:
    """PyTorch Lightning's Trainer with GradientAccumulationScheduler, each rank given its own loader."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
    from lightning.pytorch.strategies import DDPStrategy

    from accum_sched.backends.counting import CountingState, counting_allreduce

    net = build_model(w.model)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return sample_losses(self.net, x, y).mean()

        def configure_optimizers(self):
            return make_optimizer(w, self.parameters())

    class Timing(Callback):
        def on_train_start(self, trainer, module):
            # DDPStrategy(ddp_comm_hook=...) registers hooks on CUDA only; on CPU register the counter ourselves
            trainer.strategy.model.register_comm_hook(counter, counting_allreduce)

        def on_train_epoch_start(self, trainer, module):
            rec.epoch_start(trainer.current_epoch)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            while rec.steps < trainer.global_step:  # global_step counts optimizer steps
                rec.step()

        def on_train_epoch_end(self, trainer, module):
            rec.epoch_end(trainer.current_epoch)

    counter = CountingState()
    rec.counts = lambda: (counter.rounds, counter.bytes)
    trainer = pl.Trainer(
        accelerator="cpu", devices=w.world, num_nodes=1, max_epochs=w.epochs,
        strategy=DDPStrategy(process_group_backend="gloo"),
        callbacks=[GradientAccumulationScheduler(scheduling=w.schedule()), Timing()],
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0)
    x, y = rank_data(w, int(__import__("os").environ["RANK"]))
    trainer.fit(Module(), train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=w.micro, shuffle=False))
    return net


def run_accelerate(w: Workload, rec) -> torch.nn.Module:
    """Hugging Face Accelerate: accumulate() with gradient_accumulation_steps changed at each epoch start."""
    from accelerate import Accelerator

    from accum_sched.backends.counting import CountingState, counting_allreduce

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    # Accelerate shards the loader it prepares (rank r takes batches r, r + world, ...): interleave every rank's
    # micro-batches so that each rank ends up with exactly its own data, as in the other variants.
    per_rank = [rank_data(w, r) for r in range(w.world)]
    xs = [d[0][i * w.micro:(i + 1) * w.micro] for i in range(w.batches) for d in per_rank]
    ys = [d[1][i * w.micro:(i + 1) * w.micro] for i in range(w.batches) for d in per_rank]
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=w.micro, shuffle=False)
    net = build_model(w.model)
    model, optimizer, loader = accelerator.prepare(net, make_optimizer(w, net.parameters()), loader)
    counter = CountingState()
    model.register_comm_hook(counter, counting_allreduce)
    rec.counts = lambda: (counter.rounds, counter.bytes)
    first = next(iter(loader))[0]
    assert torch.equal(first, per_rank[rank][0][:w.micro]), "Accelerate handed this rank another rank's data"
    for epoch in range(w.epochs):
        accelerator.gradient_accumulation_steps = w.factor_of_epoch(epoch)
        rec.epoch_start(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(sample_losses(model, x, y).mean())  # divides by the configured steps
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                rec.step()
        rec.epoch_end(epoch)
    return net


VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("no_sync", "hand-written no_sync loop", run_no_sync),
    Variant("engine", "accum_sched engine (DDP)", run_engine),
    Variant("every", "DDP, sync every micro-batch", run_every_micro_batch),
    Variant("lightning", "Lightning + GradAccumScheduler", run_lightning, requires=("lightning",), exact=False,
            note="divides a partial window by the configured factor"),
    Variant("accelerate", "Accelerate accumulate()", run_accelerate, requires=("accelerate",), exact=False,
            note="divides a partial window by the configured steps"),
]}
BASELINE = "no_sync"  # ratios are relative to this row

# DeepSpeed rows (issue 7): accum_sched's DeepSpeed back end at ZeRO 0 and 2, and DeepSpeed alone with a GAS per
# epoch, in bench/variants_deepspeed.py; their collectives are counted in deepspeed.comm (no DDP comm hook there).
from variants_deepspeed import variants as _deepspeed_variants  # noqa: E402

DEEPSPEED_VARIANTS: dict[str, Variant] = _deepspeed_variants(Variant)
VARIANTS.update(DEEPSPEED_VARIANTS)

# FSDP2 rows (issue 11): the engine's FSDP2 back end next to a hand-written FSDP2 loop, both gradient-sync modes;
# collectives counted in torch.distributed (all-gathers, reduce-scatters, all-reduces).
from variants_fsdp import variants as _fsdp_variants  # noqa: E402

FSDP_VARIANTS: dict[str, Variant] = _fsdp_variants(Variant)
VARIANTS.update(FSDP_VARIANTS)
# (engine row, its hand-written baseline)
FSDP_PAIRS = (("fsdp-b", "fsdp-b-hand"), ("fsdp-e", "fsdp-e-hand"), ("fsdp-b-keep", "fsdp-b-hand"))
