"""Hugging Face Trainer runs under torchrun (2 gloo CPU ranks, DDP), each rank saving what the tests compare with
tests/hf_reference.py's plain-torch large-batch reference.

    torchrun --nproc-per-node 2 tests/transformers_tasks.py OUT_DIR VARIANT [VARIANT ...]

Variants: ``accum`` (AccumulationTrainer, schedule hf_reference.SCHEDULE, a checkpoint saved mid-epoch at step
RESUME_AT), ``resumed`` (a fresh AccumulationTrainer resumed from that checkpoint; run after ``accum``), ``fixed``
(the plain Trainer with gradient_accumulation_steps=FIXED) and ``callback`` (the plain Trainer whose
gradient_accumulation_steps a callback sets to the schedule's factor at each epoch start). Each rank saves
``<variant>-<rank>.pt``: its parameters, optimizer steps, the LR scheduler's total (max_steps), the last LR, the
gradient all-reduces counted by the test's own counter (tests/counters.py: every all_reduce at least as large as the
model) and the seconds of ``trainer.train``.
"""
from __future__ import annotations

import os
import sys
import time

import hf_reference as ref

RESUME_AT = 9  # optimizer steps: epoch 1 (factor 2) runs steps 8-11, so this checkpoint is mid-epoch
FIXED = 2


def arguments(out_dir: str, **overrides):
    from transformers import TrainingArguments

    values = dict(output_dir=out_dir, per_device_train_batch_size=ref.MICRO, num_train_epochs=ref.EPOCHS,
                  learning_rate=ref.LR, adam_epsilon=ref.ADAM_EPS, weight_decay=0.0, optim="adamw_torch",
                  lr_scheduler_type="linear",
                  max_grad_norm=ref.MAX_GRAD_NORM, use_cpu=True, report_to=[], seed=0,
                  train_sampling_strategy="sequential", remove_unused_columns=False, disable_tqdm=True,
                  logging_steps=5, save_strategy="no", dataloader_num_workers=0)
    values.update(overrides)
    return TrainingArguments(**values)


def _factor_callback():
    from transformers import TrainerCallback

    class FactorPerEpoch(TrainerCallback):  # what users try today: mutate the Trainer's factor per epoch
        def on_epoch_begin(self, args, state, control, **kwargs):
            args.gradient_accumulation_steps = ref.factors()[int(round(state.epoch or 0))]

    return FactorPerEpoch()


def make_trainer(variant: str, out_dir: str):
    from transformers import Trainer

    from accum_sched.integrations.transformers import AccumulationTrainer

    common = dict(model=ref.make_model(), train_dataset=ref.Sequences(), data_collator=ref.collate)
    if variant == "accum":
        args = arguments(out_dir, save_strategy="steps", save_steps=RESUME_AT)
        return AccumulationTrainer(args=args, accumulation_schedule=ref.SCHEDULE, **common)
    if variant == "resumed":
        return AccumulationTrainer(args=arguments(out_dir), accumulation_schedule=ref.SCHEDULE, **common)
    if variant == "fixed":
        return Trainer(args=arguments(out_dir, gradient_accumulation_steps=FIXED), **common)
    if variant == "callback":
        return Trainer(args=arguments(out_dir), callbacks=[_factor_callback()], **common)
    raise ValueError(variant)


def run(variant: str, out_dir: str) -> dict:
    from counters import CollectiveCounter

    trainer = make_trainer(variant, out_dir)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    resume = os.path.join(out_dir, f"checkpoint-{RESUME_AT}") if variant == "resumed" else None
    counter = CollectiveCounter()
    start = time.perf_counter()
    with counter:
        trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - start
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "steps": trainer.state.global_step, "total": trainer.state.max_steps,
            "last_lr": trainer.lr_scheduler.get_last_lr()[0],
            "allreduces": sum(1 for name, numel in counter.calls if name == "all_reduce" and numel >= n_params),
            "logged_steps": [entry["step"] for entry in trainer.state.log_history if "loss" in entry],
            "seconds": seconds}


def main(out_dir: str, variants: list[str]) -> None:
    ref.save_variants(lambda variant: run(variant, out_dir), out_dir, variants)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2:])
