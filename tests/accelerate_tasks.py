"""Accelerate loops under torchrun (2 gloo CPU ranks), each rank saving what the tests compare with
tests/hf_reference.py's plain-torch large-batch reference.

    torchrun --nproc-per-node 2 tests/accelerate_tasks.py OUT_DIR VARIANT [VARIANT ...]

Variants: ``ddp`` and ``fsdp2`` (make_engine on what ``accelerator.prepare`` returned, under Accelerate's DDP and
its FSDP2 plugin), ``mutated`` (Accelerate's own ``accumulate()`` with ``gradient_accumulation_steps`` set to the
schedule's factor at each epoch start: what users try today). Each rank saves ``<variant>-<rank>.pt``: its full
parameters, optimizer steps, the LR scheduler's steps, the gradient collectives counted by the test's own counter
(tests/counters.py: all_reduces at least as large as the model, and reduce_scatters), the FSDP2 groups and the
seconds of the loop.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import hf_reference as ref


def token_loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(SUM of the next-token cross-entropy over real targets, number of real targets) of a padded micro-batch."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss, targets.ne(-100).sum()


def accelerator_for(variant: str):
    from accelerate import Accelerator

    if variant == "fsdp2":
        from accelerate import FullyShardedDataParallelPlugin
        from accelerate.utils import DistributedType

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        # Accelerate turns the FSDP plugin on for GPUs only (on CPU it stays MULTI_CPU): set what it would have set
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        return accelerator
    return Accelerator(cpu=True)


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
    engine = make_engine(accelerator, model, optimizer, ref.SCHEDULE, lr_scheduler=lr_sched,
                         max_grad_norm=ref.MAX_GRAD_NORM)
    for epoch in range(ref.EPOCHS):
        for batch in engine.micro_batches(loader, epoch):
            loss_sum, n = token_loss(model, batch)
            engine.backward(loss_sum, n)
    return accelerator, model, engine.optimizer_steps, lr_sched


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
    start = time.perf_counter()
    with counter:
        accelerator, model, steps, lr_sched = (train_mutated if variant == "mutated" else train_with_engine)(variant)
    seconds = time.perf_counter() - start
    inner = getattr(lr_sched, "scheduler", lr_sched)
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for name, p in accelerator.unwrap_model(model).named_parameters()}
    return {"params": params, "steps": steps, "lr_steps": inner.last_epoch, "seconds": seconds,
            "allreduces": sum(1 for name, numel in counter.calls if name == "all_reduce" and numel >= n_params),
            "reduce_scatters": sum(1 for name, _ in counter.calls if name == "reduce_scatter"),
            "per_sync": _reduce_scatters_of_one_sync(model) if variant == "fsdp2" else None}


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
