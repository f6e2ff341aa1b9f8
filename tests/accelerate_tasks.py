"""Accelerate loops under torchrun (2 gloo CPU ranks), each rank saving what the tests compare with
tests/hf_reference.py's plain-torch large-batch reference.

    torchrun --nproc-per-node 2 tests/accelerate_tasks.py OUT_DIR VARIANT [VARIANT ...]

Variants: ``ddp``, ``fp16``, ``bf16``, ``zero1``, ``zero2`` and ``fsdp2`` (make_engine on what
``accelerator.prepare`` returned, under Accelerate's DDP, its fp16 or bf16 mixed precision, its DeepSpeed plugin at
ZeRO 1 or 2, and its FSDP2 plugin; one Accelerate configuration per process, so these take a launch each but for
``ddp`` with ``mutated``), ``mutated`` (Accelerate's own ``accumulate()`` with ``gradient_accumulation_steps`` set
to the schedule's factor at each epoch start: what users try today). Each rank saves ``<variant>-<rank>.pt``: its full
parameters, optimizer steps, the LR scheduler's steps, the gradient collectives counted by the test's own counter
(tests/counters.py: all_reduces at least as large as the model, and reduce_scatters), the FSDP2 groups and the
seconds of the loop.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

import hf_reference as ref

token_loss = ref.token_loss
FORWARD_DTYPES: list = []  # the logits' dtype of the first forward of a run: what precision really ran


def accelerator_for(variant: str):
    from accelerate import Accelerator

    if variant == "fsdp2":
        from accelerate import FullyShardedDataParallelPlugin
        from accelerate.utils import DistributedType

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        # No public setting gives FSDP on CPU in Accelerate 1.16: AcceleratorState takes the FSDP plugin only when
        # the distributed type is MULTI_GPU/XPU/NPU/... (measured: with the plugin and ACCELERATE_USE_FSDP=true it
        # stays MULTI_CPU under cpu=True, and NO with cpu=False and a gloo InitProcessGroupKwargs). Set what it
        # sets on GPUs.
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        return accelerator
    if variant.startswith("zero"):
        return deepspeed_accelerator(int(variant[len("zero"):]))
    if variant == "fp16":  # the GradScaler's settings, as Accelerate takes them (make_engine hands them on)
        from accelerate.utils import GradScalerKwargs

        return Accelerator(cpu=True, mixed_precision="fp16",
                           kwargs_handlers=[GradScalerKwargs(init_scale=ref.FP16_INIT_SCALE)])
    if variant == "bf16":
        return Accelerator(cpu=True, mixed_precision="bf16")
    return Accelerator(cpu=True)


def deepspeed_accelerator(stage: int):
    """Accelerate's DeepSpeed plugin on CPU by public settings only: cpu=False (Accelerate takes DeepSpeed only
    then) and the process group's backend named gloo (no accelerator device to pick nccl from); DeepSpeed's CPU
    accelerator (DS_ACCELERATOR=cpu). Clipping is the engine's (max_grad_norm), so DeepSpeed's own is off."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

    ensure_torch_extensions_dir()
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1, gradient_clipping=0.0)
    return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])


def prepared(variant: str):
    accelerator = accelerator_for(variant)
    model = ref.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ref.LR, eps=ref.ADAM_EPS, weight_decay=0.0)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, ref.linear_decay(ref.total_steps()))
    loader = torch.utils.data.DataLoader(ref.Sequences(), batch_size=ref.MICRO, shuffle=False,
                                         collate_fn=ref.collate)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, lr_sched))


def train_with_engine(variant: str):
    from accum_sched.integrations.accelerate import make_engine

    accelerator, model, optimizer, loader, lr_sched = prepared(variant)
    # fp16: micro_batch_size makes the engine multiply each loss by the window's share before the backward, so the
    # fp16 gradients stay at a mean's scale (back-propagated sums overflowed the GradScaler's 2**16: 3 skipped steps)
    extra = {"micro_batch_size": ref.MICRO} if variant == "fp16" else {}
    engine = make_engine(accelerator, model, optimizer, ref.SCHEDULE, lr_scheduler=lr_sched,
                         max_grad_norm=ref.MAX_GRAD_NORM, **extra)
    # Accelerate autocasts the prepared forward for bf16 on CPU, but for fp16 only off CPU (its native_amp stays
    # False there): the fp16 forward runs under the engine's autocast, as docs/accelerate.md says
    autocast = engine.autocast if variant == "fp16" else contextlib.nullcontext
    for epoch in range(ref.EPOCHS):
        for batch in engine.micro_batches(loader, epoch):
            with autocast():
                loss_sum, n = token_loss(model, batch, FORWARD_DTYPES)
            engine.backward(loss_sum, n)
    return accelerator, model, engine, lr_sched


def train_mutated(variant: str):
    """Accelerate's accumulate(): each micro-batch's mean loss divided by the factor, its sync at the factor or the
    loader's end; the prepared scheduler steps once per process per optimizer step."""
    accelerator, model, optimizer, loader, lr_sched = prepared(variant)
    steps = 0
    for factor in ref.factors():
        accelerator.gradient_accumulation_steps = factor
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), ref.MAX_GRAD_NORM)
                    steps += 1
                optimizer.step()
                lr_sched.step()
                optimizer.zero_grad()
    return accelerator, model, steps, lr_sched


def run(variant: str) -> dict:
    from counters import CollectiveCounter

    n_params = sum(p.numel() for p in ref.make_model().parameters())
    counter = CollectiveCounter()
    FORWARD_DTYPES.clear()
    start = time.perf_counter()
    with counter:
        accelerator, model, engine, lr_sched = (train_mutated if variant == "mutated" else train_with_engine)(variant)
    seconds = time.perf_counter() - start
    steps = engine if variant == "mutated" else engine.optimizer_steps
    inner = getattr(lr_sched, "scheduler", lr_sched)
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for name, p in accelerator.unwrap_model(model).named_parameters()}
    return {"params": params, "steps": steps, "lr_steps": inner.last_epoch, "seconds": seconds,
            "allreduces": sum(1 for name, numel in counter.calls if name == "all_reduce" and numel >= n_params),
            "reduce_scatters": sum(1 for name, _ in counter.calls if name == "reduce_scatter"),
            "per_sync": _reduce_scatters_of_one_sync(model) if variant == "fsdp2" else None,
            "forward_dtype": str(FORWARD_DTYPES[0]) if FORWARD_DTYPES else None, "distributed_type": str(
                accelerator.distributed_type), "num_processes": accelerator.num_processes,
            "precision": None if variant == "mutated" else engine.precision,
            "overflow_steps": None if variant == "mutated" else engine.overflow_steps,
            "loss_scale": _loss_scale(engine), "zero_stage": _zero_stage(model)}


def _loss_scale(engine):
    scaler = getattr(getattr(engine, "backend", None), "scaler", None)
    return None if scaler is None else float(scaler.get_scale())


def _zero_stage(model):
    return model.zero_optimization_stage() if type(model).__name__ == "DeepSpeedEngine" else None


def _reduce_scatters_of_one_sync(model) -> int:
    """Reduce-scatters one forward and backward with gradient sync on launches (after training: nothing steps)."""
    from counters import CollectiveCounter

    counter = CollectiveCounter()
    with counter:
        loss_sum, _ = token_loss(model, ref.collate([{"input_ids": row} for row in ref.samples()[:ref.MICRO]]))
        loss_sum.backward()
    return sum(1 for name, _ in counter.calls if name == "reduce_scatter")


def main(out_dir: str, variants: list[str]) -> None:
    ref.save_variants(run, out_dir, variants)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2:])
