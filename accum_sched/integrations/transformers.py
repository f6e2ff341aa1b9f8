"""Keep a Hugging Face ``Trainer`` and get this project's exact windows: :class:`AccumulationTrainer`.

The Trainer takes one fixed ``gradient_accumulation_steps``; changing it from a callback breaks its step totals and
its loss normalisation, and its token count (``num_items_in_batch``) counts position 0 of a causal LM whose class it
does not map to a shifting loss. Here the :class:`~accum_sched.AccumulationEngine` forms the windows instead, and
the Trainer sees one *window* per training step (its ``gradient_accumulation_steps`` stays 1):

* the train loader the Trainer iterates is wrapped so that each item is a window the engine fills from the Trainer's
  own per-rank loader (its sampler, ``train_sampling_strategy``, seed and sharding as they are);
* :meth:`AccumulationTrainer.training_step` runs the window's micro-batches: each forward and backward inside the
  engine's sync context (DDP ``no_sync()`` off the boundary), each loss the SUM over real target tokens (labels
  shifted for causal LMs) with its count. After the boundary backward it takes the next micro-batch, which makes
  the engine close the window: the gradient is divided by the window's global token count, at its real size;
* the engine's optimizer is a stand-in that leaves ``step()`` and ``zero_grad()`` to the Trainer, which then clips,
  steps, advances its LR scheduler, counts ``global_step`` and logs, evaluates and saves as usual;
* the LR scheduler's total is the schedule's exact optimizer-step total (``max_steps``), and each checkpoint holds
  the engine's position (``accum_sched_state-<rank>.pt``) so a mid-epoch resume continues the same windows.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from accum_sched.engine import AccumulationEngine
from accum_sched.planning import simulate_windows
from accum_sched.schedule import AccumulationSchedule

STATE_FILE = "accum_sched_state-{rank}.pt"
_END = object()


class _TrainerSteps:
    """The optimizer the engine steps: the Trainer's param groups, with ``step()`` and ``zero_grad()`` left to the
    Trainer, which runs them on the normalised gradient right after :meth:`AccumulationTrainer.training_step`."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    def step(self, closure=None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class _Window:
    """One optimizer step's micro-batches, read from the engine's generator by ``training_step``."""

    def __init__(self, source, first, loader):
        self.source, self.first, self.loader = source, first, loader
        self.next = _END  # the next window's first micro-batch (taken to close this window), or _END
        self.batches: list = []  # the prepared micro-batches, for the Trainer's FLOP and token counts
        self.done = False


class _EngineProgress(TrainerCallback):
    """Puts the engine's epoch position in ``state.epoch`` after each step (what the Trainer logs), and its state
    in each checkpoint."""

    def __init__(self, trainer: AccumulationTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        state.epoch = self.trainer._epoch_progress

    def on_save(self, args, state, control, **kwargs):
        """Each rank's engine position into the checkpoint the Trainer just wrote (the public hook right after
        its save; hyperparameter-search trials, which save under a run folder of their own, are not resumable)."""
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.trainer._snapshot, os.path.join(folder, STATE_FILE.format(rank=args.process_index)))


class _WindowLoader:
    """The Trainer's per-rank train loader seen one window at a time. ``len()`` is the number of micro-batches, an
    upper bound on windows: the Trainer's loop asks for that many and gets nothing once the epoch's windows end."""

    def __init__(self, trainer: AccumulationTrainer, loader):
        self.trainer, self.loader, self.epoch = trainer, loader, 0

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)

    @property
    def batch_sampler(self):
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self):
        return self.loader.dataset

    def __iter__(self):
        return self.trainer._windows(self.loader, self.epoch)


class AccumulationTrainer(Trainer):
    """A ``transformers.Trainer`` whose accumulation factor follows ``accumulation_schedule``.

    Args:
        accumulation_schedule: anything :class:`~accum_sched.AccumulationSchedule` accepts (``{6: 2, 11: 4}``,
            ``"0:1,5:2"``, an int, or a schedule with its unit: epoch, step or samples).
        causal_lm: whether labels are shifted (token t predicts label t+1); None: a model registered as a causal LM
            with transformers (``GPT2LMHeadModel`` included), or a batch with ``shift_labels``.
        *args, **kwargs: everything ``Trainer`` takes. ``args.gradient_accumulation_steps`` must stay 1.

    Override :meth:`accumulation_loss` for a loss other than token cross-entropy.
    """

    def __init__(self, *args, accumulation_schedule: Any = 1, causal_lm: bool | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.accumulation_schedule = AccumulationSchedule(accumulation_schedule)
        self.causal_lm = causal_lm
        _check_arguments(self)
        self.engine = None
        self._resume_state: dict | None = None
        self._snapshot: dict | None = None  # the engine's state after its last window (what a checkpoint saves)
        self._windows_in_epoch = 0
        self._epoch_progress = 0.0
        self.add_callback(_EngineProgress(self))

    # -- the step total ------------------------------------------------------------------------------------------
    def set_initial_training_values(self, args, dataloader):
        epochs, _, examples, samples, total_batch, _, max_steps = super().set_initial_training_values(args,
                                                                                                      dataloader)
        if not hasattr(dataloader, "__len__"):
            raise ValueError("AccumulationTrainer needs a train dataset with len() (windows end at epoch ends)")
        batches = len(dataloader)
        per_step = {"samples_per_micro_step": self._train_batch_size * args.world_size}
        if self.accumulation_schedule.unit == "tokens":
            raise ValueError("AccumulationTrainer: a tokens-keyed accumulation_schedule has no step total known "
                             "before training here; key it by epoch, step or samples")
        if args.max_steps > 0:
            max_steps, epochs = args.max_steps, self._epochs_for(batches, args.max_steps, per_step)
        else:
            if args.num_train_epochs != int(args.num_train_epochs):
                raise ValueError(f"AccumulationTrainer: num_train_epochs={args.num_train_epochs} must be whole "
                                 f"(windows end at epoch ends); or set max_steps")
            epochs = int(args.num_train_epochs)
            max_steps = self.accumulation_schedule.optimizer_steps(batches, epochs, **per_step)
        return epochs, batches, examples, samples, total_batch, batches, max_steps

    def _epochs_for(self, batches: int, max_steps: int, per_step: dict) -> int:
        """Epochs it takes the schedule to reach ``max_steps`` optimizer steps."""
        steps = 0
        for epoch, _, _ in simulate_windows(self.accumulation_schedule, batches, max_steps, **per_step):
            steps += 1
            if steps >= max_steps:
                return epoch + 1
        return max_steps

    # -- the engine, on the objects the Trainer prepared ---------------------------------------------------------
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, loader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self.engine = AccumulationEngine(model, _TrainerSteps(self.optimizer), self.accumulation_schedule,
                                         uneven="error")
        self.engine.on_step(self._after_window)
        if self._resume_state is not None:
            self.engine.load_state_dict(self._resume_state)
            self._resume_state = None
        return model, _WindowLoader(self, loader)

    def _after_window(self, info) -> None:
        # called by the engine between windows, where its state is whole
        self._windows_in_epoch += 1
        self._snapshot = {"engine": self.engine.state_dict(), "windows_in_epoch": self._windows_in_epoch}

    def _windows(self, loader, epoch: int):
        engine = self.engine
        if engine.resume_offset(epoch) == 0:
            self._windows_in_epoch = 0
        source = engine.micro_batches(loader, epoch)  # on resume it reads and drops what was trained
        batch = next(source, _END)
        while batch is not _END:
            window = _Window(source, batch, loader)
            yield window
            if not window.done:
                raise RuntimeError("accum_sched: the Trainer took a window without training it")
            batch = window.next

    # -- one window per Trainer step -----------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        window = next(epoch_iterator, None)
        return ([] if window is None else [window]), None

    def get_resumed_dataloader(self, dataloader, num_batches):
        return dataloader  # the engine skips the trained micro-batches itself (it knows where its windows were)

    def training_step(self, model, inputs, num_items_in_batch=None):
        window, engine = inputs, self.engine
        model.train()
        steps = engine.optimizer_steps
        batch = window.first
        while True:
            prepared = self._prepare_inputs(batch)
            window.batches.append(prepared)
            with self.compute_loss_context_manager():
                loss_sum, count = self.accumulation_loss(model, prepared)
            engine.backward(loss_sum, count)
            # the next micro-batch: after the boundary backward this is what makes the engine close the window
            batch = next(window.source, _END)
            if batch is _END or engine.optimizer_steps != steps:
                break
        window.next, window.done = batch, True
        if batch is _END:  # the epoch is over (the engine is at the next one): a checkpoint now resumes there
            self._windows_in_epoch = 0
            self._snapshot = {"engine": engine.state_dict(), "windows_in_epoch": 0}
        # the Trainer's epoch fraction counts its steps as micro-batches; the engine knows where the epoch stands
        self._epoch_progress = engine.epoch_index + engine.resume_offset(engine.epoch_index) / len(window.loader)
        info = engine.last_step
        if info.skipped:  # no elements, or a non-finite loss: the Trainer's step after this one moves nothing
            model.zero_grad(set_to_none=True)
        return torch.tensor(info.loss, device=self.args.device)

    def accumulation_loss(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss SUM, element count)`` of one micro-batch: cross-entropy summed over every label that is not -100
        (for causal LMs, labels shifted by one: the targets), and how many such targets there are."""
        inputs = dict(inputs)
        shift_labels = inputs.pop("shift_labels", None)
        labels = inputs.pop("labels", None)
        if labels is None and shift_labels is None:
            raise ValueError("AccumulationTrainer: the batch has no 'labels'; add them (a data collator) or override "
                             "accumulation_loss(model, inputs) -> (loss_sum, n_elements)")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if shift_labels is not None:
            targets = shift_labels
        elif self._shifts_labels():
            logits, targets = logits[..., :-1, :], labels[..., 1:]
        else:
            targets = labels
        targets = targets.to(logits.device)
        loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                                                     ignore_index=-100, reduction="sum")
        return loss_sum, targets.ne(-100).sum()

    def _shifts_labels(self) -> bool:
        if self.causal_lm is None:
            name = type(self.accelerator.unwrap_model(self.model)).__name__
            self.causal_lm = name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() or bool(self._loss_shifts_labels)
        return self.causal_lm

    def floating_point_ops(self, inputs) -> int:
        return sum(super(AccumulationTrainer, self).floating_point_ops(batch) for batch in inputs.batches)

    def _track_num_input_tokens(self, inputs) -> None:
        for batch in inputs.batches:
            super()._track_num_input_tokens(batch)

    # -- resume: the engine's position travels with the Trainer's (saved by _EngineProgress.on_save) -------------
    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):
        epochs_trained, steps_in_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial)
        self._resume_state = None
        if resume_from_checkpoint is None:
            return epochs_trained, steps_in_epoch
        path = os.path.join(resume_from_checkpoint, STATE_FILE.format(rank=self.args.process_index))
        if not os.path.isfile(path):
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint}: no {os.path.basename(path)} (not "
                             f"written by AccumulationTrainer); resume from one of its checkpoints")
        saved = torch.load(path, weights_only=True)
        self._resume_state = saved["engine"]
        self._windows_in_epoch = int(saved["windows_in_epoch"])
        return int(saved["engine"]["epoch_index"]), self._windows_in_epoch


def _check_arguments(trainer: AccumulationTrainer) -> None:
    """One line naming the setting and the fix, for what the windows here cannot honour."""
    args = trainer.args
    if args.gradient_accumulation_steps != 1:
        raise ValueError(f"TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps}) and "
                         f"AccumulationTrainer(accumulation_schedule=...) both set the factor: leave "
                         f"gradient_accumulation_steps at 1 and give the factor in accumulation_schedule")
    if args.deepspeed:
        raise ValueError("AccumulationTrainer does not run TrainingArguments(deepspeed=...): use accum-sched's "
                         "launcher (distributed.backend: deepspeed, docs/hf.md) or an Accelerate loop with "
                         "accum_sched.integrations.accelerate.make_engine and Accelerate's DeepSpeed plugin")
    if args.fsdp:
        raise ValueError("AccumulationTrainer does not run TrainingArguments(fsdp=...): use an Accelerate loop with "
                         "accum_sched.integrations.accelerate.make_engine and Accelerate's FSDP2 plugin")
    if args.fp16:
        raise ValueError("AccumulationTrainer: TrainingArguments(fp16=True) is not supported (the Trainer's loss "
                         "scaler never sees the engine's backward); use bf16=True or fp32")
    if args.n_gpu > 1:
        raise ValueError(f"AccumulationTrainer: {args.n_gpu} GPUs in one process (DataParallel); launch one process "
                         f"per GPU (torchrun) instead")
    custom_loss = type(trainer).accumulation_loss is not AccumulationTrainer.accumulation_loss
    if not custom_loss and (trainer.compute_loss_func is not None or args.label_smoothing_factor):
        raise ValueError("AccumulationTrainer: compute_loss_func / label_smoothing_factor are not applied here; "
                         "override accumulation_loss(model, inputs) -> (loss_sum, n_elements) instead")
    if not math.isfinite(args.max_grad_norm or 0.0):
        raise ValueError(f"max_grad_norm={args.max_grad_norm} must be finite (or 0 for no clipping)")


__all__ = ["AccumulationTrainer", "STATE_FILE"]
