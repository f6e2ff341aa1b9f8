"""One rank's training: the process group, the task, the engine, the loop (launcher/worker.py is the entry point).

torchrun runs it (and srun, and the `deepspeed` launcher, which adds --local_rank). It reads the resolved config,
joins the process group, builds the task and the engine, trains, and leaves model.pt, metrics.jsonl and
summary.json (rank 0). The loop reads top to bottom; everything clever lives in accum_sched.
"""
from __future__ import annotations

import logging
import os
import random
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from accum_sched import AccumulationEngine
from accum_sched.invariant import InvariantBatchSampler, InvariantCollate
from accum_sched.planning import simulate_windows
from accum_sched.resume import ResumeSampler
from launcher import backends, tasks
from launcher.backends.compile import CompileClock, compile_stats
from launcher.checkpoint import coordination
from launcher.checkpoint.checkpointer import Checkpointer
from launcher.checkpoint.parts import SamplerEpoch
from launcher.config import Config
from launcher.config.noise import adaptive_settings as adaptive_defaults
from launcher.errors import ConfigError
from launcher.launch.env import choose_device, detect
from launcher.train import plan, schedule_from, streams, trackers
from launcher.train.data_size import too_small
from launcher.train.factors import run_factors
from launcher.train.metrics import (
    MetricsWriter,
    Progress,
    Throughput,
    atomic_write_json,
    epoch_seconds,
    eta_seconds,
    planned_micro_batches,
    read_jsonl,
    report_line,
    steps_after_resume,
    stream_remaining_micro_batches,
)
from launcher.train.optim import build_lr_scheduler, build_optimizer
from launcher.train.preempt import requeue
from launcher.train.validation import Validation

try:  # seeded where installed (torch does not need it)
    import numpy as np
except ImportError:
    np = None

log = logging.getLogger("accum_sched.worker")


def to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


def detect_launch():
    """Rank, local rank, world size and rendezvous address of this process (see launcher/launch/env.py)."""
    return detect()


def init_distributed(cfg: Config, launch) -> torch.device:
    """Join the process group (NCCL with CUDA, gloo otherwise, unless configured) and pin this rank's device."""
    wanted = cfg.distributed.process_group
    # which GPU, if any: per-task SLURM binding and CUDA_VISIBLE_DEVICES decide, not the local rank alone
    kind, index = choose_device(wanted, torch.cuda.device_count() if torch.cuda.is_available() else 0, launch)
    use_cuda = kind == "cuda"
    device = torch.device("cuda", index) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if launch.world_size > 1 or launch.source != "single":
        backend = ("nccl" if use_cuda else "gloo") if wanted == "auto" else wanted
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        timeout = timedelta(seconds=cfg.distributed.timeout_s)
        where = {"init_method": "env://"}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun keeps its store across restarts of a failed worker group and env:// does not prefix the keys
            # by attempt (torch 2.13), so a restarted group read the dead group's gloo addresses and failed to
            # connect (tests/launcher/checkpoint/test_checkpoint.py). Give every attempt its own key space.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launch.world_size,
                                  is_master=False, timeout=timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            where = {"store": dist.PrefixStore(f"accum-sched/attempt_{attempt}", store)}
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout,
                                device_id=device if use_cuda else None, **where)
        # checkpoints wait on gloo, never under NCCL's watchdog; checkpoint.async writes on a group of its own
        coordination.start(cfg.checkpoint.timeout_s, background=cfg.checkpoint.async_)
    return device


def adaptive_settings(cfg: Config) -> dict | None:
    """``accumulation.adaptive`` with its defaults, or None (checked already by config validation)."""
    return None if cfg.accumulation.adaptive is None else adaptive_defaults(cfg.accumulation.adaptive)


def plan_total_steps(schedule, loader, sampler, task, cfg: Config, world: int) -> int:
    """Optimizer steps of the run, for LR schedulers and progress: exact for a map-style dataset (under every
    schedule unit), at most ``run.max_steps``; for a stream, ``run.max_steps`` (its length is not known ahead)."""
    max_steps = cfg.run.max_steps
    if isinstance(sampler, InvariantBatchSampler):  # every epoch's windows are laid out ahead
        total = sum(windows for _, windows in sampler.plan(cfg.run.epochs))
        return total if max_steps is None else min(total, max_steps)
    if streams.is_stream(task.dataset):
        if max_steps is None and cfg.lr_scheduler is not None and cfg.lr_scheduler.name != "constant":
            raise ConfigError("run.max_steps", f"is null, but the task's dataset is a stream, whose steps are not "
                              f"known ahead, and lr_scheduler {cfg.lr_scheduler.name} decays over the run's total",
                              "set run.max_steps (the scheduler decays over it), or use lr_scheduler: constant")
        return max_steps or 0
    total = _map_style_steps(schedule, loader, sampler, task, cfg, world)
    return total if max_steps is None else min(total, max_steps)


def _map_style_steps(schedule, loader, sampler, task, cfg: Config, world: int) -> int:
    """Exact optimizer steps of ``run.epochs`` epochs over a map-style dataset, under every schedule unit.

    Samples per micro-step are known from the sharding (DistributedSampler gives every rank the same count);
    tokens come from one pass over the dataset, shared by the ranks (launcher/train/plan.py), then from indices alone.
    """
    batches, epochs, micro = len(loader), cfg.run.epochs, cfg.data.micro_batch_size
    if schedule.unit in ("epoch", "step"):
        return schedule.optimizer_steps(batches, epochs)
    per_rank = len(sampler)  # samples per rank per epoch (padded to equal length across ranks)
    if schedule.unit == "samples":
        return schedule.optimizer_steps(batches, epochs,
                                        samples_per_micro_step=lambda e, i: world * min(micro, per_rank - i * micro))
    if task.count_fn is None and task.length_fn is None:
        if cfg.lr_scheduler is None:
            return 0  # nothing needs the total; progress shows steps without one
        raise ConfigError("accumulation.unit", "tokens-keyed schedules need the task's length_fn or count_fn to "
                          "plan LR totals", "return length_fn(sample) -> tokens (or count_fn(batch)) from the task, "
                          "or set lr_scheduler: null")
    rank = dist.get_rank() if dist.is_initialized() else 0
    counts = plan.sample_counts(task, rank, world)
    per_step = plan.micro_step_counts(counts, task.dataset, epochs, world, micro, batches, cfg.data.shuffle,
                                      cfg.run.seed)
    return schedule.optimizer_steps(batches, epochs, tokens_per_micro_step=lambda e, i: per_step[e][i])


def check_enough_data(task, sampler, loader, cfg: Config, world: int) -> None:
    """Raise ConfigError (the same on every rank, so only rank 0 prints it) when an epoch would give a rank no
    micro-batch (launcher/train/data_size.py); a stream's length is unknown: not checked."""
    if streams.is_stream(task.dataset) or (len(task.dataset) and len(loader)):
        return
    err = too_small(cfg.task.target, len(task.dataset), world, cfg.data.micro_batch_size, cfg.data.drop_last,
                    cfg.data.sampler)
    if err is None:  # the loader disagrees with the sampler's arithmetic (a task's own collate or sampler)
        err = ConfigError("data.micro_batch_size", f"is {cfg.data.micro_batch_size}, but the loader of each rank's "
                          f"{len(sampler)} samples gives no micro-batch", "give the task more samples")
    err.every_rank = True  # launcher/worker.py: rank 0 says it for all
    raise err


class Trainer:
    """Holds everything one rank trains with; `fit()` is the loop, `_after_step` what follows every step."""

    def __init__(self, cfg: Config, device: torch.device, resume: str | None = None):
        self.cfg, self.device, self.resume = cfg, device, resume
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.run_dir = cfg.run.output_dir
        seed_everything(cfg.run.seed)  # identical initial weights on every rank
        self.task = tasks.build(cfg.task.target, cfg.task.args)
        self.sampler, self.loader = self._make_loader()
        check_enough_data(self.task, self.sampler, self.loader, cfg, self.world)  # before anything is written
        # before a resume starts the loader mid-epoch (ResumeSampler's length is then what is left of the epoch)
        self.batches_per_epoch = None if streams.is_stream(self.task.dataset) else len(self.loader)
        # finds the checkpoint to resume (rank 0 reads, all agree); its world size may rescale the schedule
        self.checkpointer = Checkpointer(cfg, self.rank, self.world, resume, device)
        self.converted = self._schedule_from()  # accumulation.schedule_from: the schedule and LR per step
        self.adaptive = adaptive_settings(cfg)
        self.factors = run_factors(cfg, self.world, self.checkpointer.plan, self.converted, self.adaptive)
        self.schedule = self.factors.schedule
        if isinstance(self.sampler, InvariantBatchSampler):  # its windows follow the factors (rescaled on resume)
            self.sampler.set_schedule(self.factors.engine)
            self.batches_per_epoch = len(self.loader)  # epoch 0's; another factor gives another length
        self.total_steps = plan_total_steps(self.factors.planned, self.loader, self.sampler, self.task, cfg, self.world)
        if self.converted is not None and self.total_steps != self.converted.total_steps:
            raise RuntimeError(f"schedule_from planned {self.converted.total_steps} optimizer steps, the run has "
                               f"{self.total_steps}")  # the two planners disagree: a bug, not a config error
        # the back end wraps the model and builds the optimizer when it needs it (FSDP2: after sharding)
        self.backend = backends.get(cfg.distributed.backend)
        self.setup = self.backend.setup(cfg, self.task.model.to(device), self._make_optimizer, device, self.world)
        self.model, self.optimizer, self.lr_scheduler = self.setup.model, self.setup.optimizer, self.setup.lr_scheduler
        self.engine = self._make_engine()
        self.metrics = None
        self.trackers = None  # rank 0: logging.wandb / logging.mlflow (launcher/train/trackers.py)
        self.progress = None
        self.start = time.time()
        self.validation = self._make_validation()
        self.early_stopped = False
        self.preempted = False  # set by stop_for_preemption (the worker's exit status in an elastic run)

    # -- building ---------------------------------------------------------------------------------------------
    def _make_loader(self):
        """This rank's sampler and loader. ResumeSampler: a resume starts the loader at the resume point (only
        indices are skipped; the engine is told skip=False). A stream (IterableDataset): its sharded loader, whose
        state a checkpoint saves (launcher/train/streams.py), and its epoch for the sampler part."""
        cfg, task = self.cfg, self.task
        if streams.is_stream(task.dataset):
            if cfg.data.sampler == "invariant":
                err = ConfigError("data.sampler", "invariant needs a map-style dataset (it slices each epoch's "
                                  "order), but the task's dataset is a stream", "set data.sampler: distributed")
                err.every_rank = True  # launcher/worker.py: rank 0 says it for all
                raise err
            return streams.build(task, cfg, self.rank, self.world, pin_memory=self.device.type == "cuda")
        if cfg.data.sampler == "invariant":  # accum_sched.invariant; the factors are set once known (__init__)
            sampler = InvariantBatchSampler(len(task.dataset), self.world, self.rank, cfg.data.micro_batch_size,
                                            shuffle=cfg.data.shuffle, seed=cfg.run.seed)
            loader = DataLoader(task.dataset, batch_sampler=sampler, num_workers=cfg.data.num_workers,
                                collate_fn=InvariantCollate(task.dataset, task.collate_fn),
                                pin_memory=self.device.type == "cuda")
            return sampler, loader
        sampler = DistributedSampler(task.dataset, num_replicas=self.world, rank=self.rank,
                                     shuffle=cfg.data.shuffle, seed=cfg.run.seed, drop_last=False)
        loader = DataLoader(task.dataset, batch_size=cfg.data.micro_batch_size, sampler=ResumeSampler(sampler),
                            drop_last=cfg.data.drop_last, num_workers=cfg.data.num_workers,
                            collate_fn=task.collate_fn, pin_memory=self.device.type == "cuda")
        return sampler, loader

    def _schedule_from(self):
        """``accumulation.schedule_from``'s converted run (launcher/train/schedule_from.py), or None."""
        if self.cfg.accumulation.schedule_from is None:
            return None
        if streams.is_stream(self.task.dataset):
            raise ConfigError("accumulation.schedule_from", "needs a map-style dataset (its length places the "
                              "factors), but the task's dataset is a stream", "write accumulation.schedule instead")
        return schedule_from.convert(self.cfg, len(self.task.dataset), self.world)

    def _make_optimizer(self, module):
        """The optimizer and LR scheduler of ``module`` (the module: no_decay matches its parameter names)."""
        optimizer = build_optimizer(self.cfg.optimizer, module)
        if self.converted is not None:  # schedule_from: the converted run's LR per step
            return optimizer, schedule_from.lr_scheduler(self.converted, optimizer)
        return optimizer, build_lr_scheduler(self.cfg.lr_scheduler, optimizer, self.total_steps)

    def _make_engine(self) -> AccumulationEngine:
        cfg, acc = self.cfg, self.cfg.accumulation
        return AccumulationEngine(
            self.setup.module, schedule=self.factors.engine, **self.setup.engine_args,
            max_grad_norm=cfg.optimizer.max_grad_norm, normalize=acc.normalize, uneven=acc.uneven,
            nonfinite=acc.nonfinite, precision=cfg.run.precision, micro_batch_size=cfg.data.micro_batch_size,
            lr_coupling=acc.lr_coupling, co_scale=acc.co_scale, noise_scale=acc.noise_scale, adaptive=self.adaptive,
            stop_at="micro_batch",  # preemption within ~2 polls (DeepSpeed fp16, noise scale: boundary)
            stop_poll_every=cfg.distributed.stop_poll_every, stop_poll_min_ms=cfg.distributed.stop_poll_min_ms,
            norm_every=cfg.logging.log_every)

    def _make_validation(self):
        if self.task.val_dataset is None:
            if self.cfg.eval.early_stop is not None:
                raise ConfigError("eval.early_stop", "needs a validation set, but the task returns no val_dataset",
                                  "return val_dataset from the task, or remove eval.early_stop")
            return None
        return Validation(self.cfg, self.task, self.setup.module, self.device, self.rank, self.engine.autocast,
                          lambda batch: to_device(batch, self.device), self.final_state_dict, self.run_dir,
                          self.start)

    # -- training ---------------------------------------------------------------------------------------------
    def loss_fn(self, model, batch):
        return self.task.loss_fn(model, to_device(batch, self.device))

    def fit(self) -> None:
        """Resume (if any), open the outputs, train epoch by epoch, then finish or answer the preemption. A failure
        first waits for the checkpoint in flight (checkpoint.async), so that it is committed as it would have been."""
        try:
            self._fit()
        except BaseException:
            self.checkpointer.wait(failing=True)
            raise

    def _fit(self) -> None:
        self._resume()
        self._open_outputs()
        self.engine.on_step(self._after_step)  # the only callback: the step's order is written there
        last = self.cfg.run.epochs if not (self.early_stopped or self._reached_max_steps()) else 0
        for epoch in range(self.engine.epoch_index, last):
            began = time.time()
            self.sampler.set_epoch(epoch)
            self.engine.train_epoch(self.checkpointer.loader(epoch, self.loader), self.loss_fn, epoch, skip=False)
            if self.engine.should_stop:  # preempted, stopped early or at max_steps: that step is saved already
                break
            self._after_epoch(epoch, began)
            if self.early_stopped:
                break
        if self.engine.should_stop and not (self.early_stopped or self._reached_max_steps()):
            self.stop_for_preemption()
        else:
            self.finish()

    def _resume(self) -> None:
        # before the metrics writer: it cuts metrics.jsonl back to the checkpoint
        step = self.checkpointer.restore(self.checkpoint_parts(), self.loader)
        if self.validation is not None:
            self.validation.truncate(step)  # eval.jsonl likewise
            self.early_stopped = self.validation.stop  # a resumed run that had stopped early stays stopped

    def _open_outputs(self) -> None:
        """Rank 0: metrics.jsonl, the progress display, and the run's first line."""
        if self.rank != 0:
            return
        cfg = self.cfg
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics = MetricsWriter(self.run_dir, cfg.logging.tensorboard, self.start)
        self.shown_total = self._resumed_total()
        self.progress = Progress(cfg.logging.progress, cfg.run.epochs, self.shown_total, cfg.logging.log_every)
        # throughput over the last log_every steps; elapsed_s goes on from a resumed run's last kept line
        self.throughput = Throughput(cfg.logging.log_every, self._counts_tokens(), self.metrics.elapsed_before)
        self.planned_micro_batches = self._planned_micro_batches()
        self.trackers = trackers.start(cfg, self.run_dir, resumed=self.resume is not None)
        per_epoch = "a stream of" if streams.is_stream(self.task.dataset) else len(self.loader)
        steps = self.shown_total or "unplanned"
        print(f"accum-sched: world {self.world}, {per_epoch} micro-batches of "
              f"{cfg.data.micro_batch_size} per rank per epoch, {cfg.run.epochs} epochs, "
              f"{steps} optimizer steps, " + (
                  f"schedule {self.schedule.to_dict()}" if self.adaptive is None else
                  f"adaptive factor {self.adaptive['min_factor']}..{self.adaptive['max_factor']} (at most "
                  f"that many steps)"), flush=True)
        self.compile_clock = CompileClock(self.model)  # run.compile: a line before the first step's compilation

    def _after_step(self, info) -> None:
        """What follows every optimizer step, on every rank, in this order (the engine's one on_step callback):

        1. the step's metrics.jsonl line and progress (rank 0);
        2. evaluation when due; early stopping sets ``engine.should_stop`` (same numbers on every rank);
        3. ``run.max_steps`` reached: ``engine.should_stop`` (the same step on every rank);
        4. the checkpoint: every ``checkpoint.every_n_steps`` steps, and whenever the engine is to stop (early stop
           or max_steps above, or the ranks' agreed preemption), so that a stop always has its step saved;
        5. the stop itself: with ``should_stop`` set the engine leaves the epoch after this callback and fit()
           finishes (early stop, max_steps) or answers the preemption.
        """
        if self.metrics is not None:
            speed = self.throughput.add(info, paused=self.compile_clock.after_step(info.step))
            record = self.metrics.write(info, self.engine.effective_batch, speed)
            if self.trackers is not None:
                self.trackers.log_step(record if isinstance(record, dict) else info.to_dict())
            eta = eta_seconds(self._remaining_micro_batches(info), speed["seconds_per_micro_batch"])
            self.progress.step(info, self.engine.effective_batch, speed, eta)
        if self.validation is not None and self.validation.due_after_step(info.step):
            self.validate(info.epoch)
            if self.early_stopped:
                self.engine.should_stop = True  # ends the epoch's loop after this step, on every rank
        if self._reached_max_steps():
            self.engine.should_stop = True
        self.checkpointer.on_step(info)

    def _counts_tokens(self) -> bool:
        """Whether a step's ``elements`` are tokens (tokens_per_s): the task declares a token count (count_fn or
        length_fn, the task contract's "elements (tokens)" counters), or the schedule is keyed by tokens. Anything
        else (builtin:regression: one element per sample) reports tokens_per_s null."""
        task = self.task
        return task.count_fn is not None or task.length_fn is not None or self.schedule.unit == "tokens"

    def _resumed_total(self) -> int:
        """The total progress and the first line show: for a resume under checkpoint.force_resume (another
        schedule, as `accum-sched cbs` branches), this run's own steps to its end (at most run.max_steps) counted
        from where it resumed, for a map-style epoch- or step-keyed schedule; else the planned total. The LR
        scheduler keeps ``total_steps``."""
        engine, cfg = self.engine, self.cfg
        if (engine.optimizer_steps == 0 or not self.checkpointer.plan.diffs or self.adaptive is not None
                or streams.is_stream(self.task.dataset) or self.schedule.unit not in ("epoch", "step")):
            return self.total_steps  # a resume under the config it was saved with: the planned total is its own
        own = steps_after_resume(self.schedule, self.batches_per_epoch, cfg.run.epochs, engine.epoch_index,
                                 engine.micro_in_epoch, engine.optimizer_steps,
                                 engine.optimizer_steps - engine.overflow_steps)
        return own if cfg.run.max_steps is None else min(own, cfg.run.max_steps)

    def _planned_micro_batches(self) -> int | None:
        """Micro-batches per rank of the whole run, the ETA's total; None where not known ahead (a stream, whose
        remainder is counted per step instead; max_steps under an adaptive factor or a tokens-keyed schedule).

        Every epoch runs all of its micro-batches whatever the factors, so without run.max_steps it is epochs x
        micro-batches per epoch; run.max_steps cuts the run after that many windows, whose sizes the schedule
        gives (a growing factor makes the last steps cost more micro-batches than the first)."""
        cfg = self.cfg
        if streams.is_stream(self.task.dataset):
            return None
        batches, max_steps = len(self.loader), cfg.run.max_steps
        if isinstance(self.sampler, InvariantBatchSampler):  # (factor, windows) of every epoch, laid out ahead
            factors = [f for f, windows in self.sampler.plan(cfg.run.epochs) for _ in range(windows)]
            return sum(factors if max_steps is None else factors[:max_steps])
        if max_steps is None:
            return batches * cfg.run.epochs
        if self.adaptive is not None or self.schedule.unit == "tokens":
            return None
        micro, per_rank = cfg.data.micro_batch_size, len(self.sampler)
        samples = (lambda e, i: self.world * min(micro, per_rank - i * micro)) if self.schedule.unit == "samples" \
            else None
        windows = (size for _, _, size in simulate_windows(self.schedule, batches, cfg.run.epochs, samples))
        return planned_micro_batches(windows, max_steps)

    def _remaining_micro_batches(self, info) -> int | None:
        """Micro-batches per rank left after this step (None: not known, no ETA). A stream knows its end only by
        run.max_steps: the steps left times their factors, by step for a step-keyed schedule, else at the current
        factor (epochs, samples and tokens of a stream are not known ahead)."""
        if self.planned_micro_batches is not None:
            return self.planned_micro_batches - self.engine.micro_steps
        max_steps = self.cfg.run.max_steps
        if not streams.is_stream(self.task.dataset) or max_steps is None:
            return None
        by_step = self.adaptive is None and self.schedule.unit == "step"
        milestones = self.schedule.milestones if by_step else ((0, info.factor),)
        return stream_remaining_micro_batches(milestones, info.step, max_steps)

    def _reached_max_steps(self) -> bool:
        return self.cfg.run.max_steps is not None and self.engine.optimizer_steps >= self.cfg.run.max_steps

    def _after_epoch(self, epoch: int, began: float) -> None:
        """At an epoch end (not stopped): evaluation when due, the epoch's checkpoint, its progress line."""
        if self.validation is not None and self.validation.due_after_epoch(epoch, self.engine.optimizer_steps):
            self.validate(epoch)
        self.checkpointer.epoch_end()
        if self.progress is not None and self.engine.last_step is not None:
            self.progress.epoch_end(epoch, self.engine.last_step.loss, time.time() - began)

    def validate(self, epoch: int) -> None:
        """Evaluate (collective); on every rank, stop when early stopping says so (same numbers everywhere)."""
        record = self.validation.run(epoch, self.engine.optimizer_steps)
        if self.metrics is not None:
            self.metrics.write_eval(record)
            if self.trackers is not None:
                self.trackers.log_eval(record)
        if self.progress is not None:
            self.progress.evaluation(record, self.validation.best, self.cfg.eval.monitor)
        if self.validation.stop:
            self.early_stopped = True

    def checkpoint_parts(self) -> dict:
        """What a checkpoint saves and restores of this trainer, by name (launcher/checkpoint/parts.py)."""
        return {"engine": self.engine, "model": self.model, "optimizer": self.optimizer,
                "scaler": self.engine.backend.scaler, "lr_scheduler": self.lr_scheduler,
                "validation": self.validation, "sampler": SamplerEpoch(self.sampler),
                "stream": self.loader if streams.is_stream(self.task.dataset) else None, "backend": self.backend,
                "setup": self.setup}

    def stop_for_preemption(self) -> None:
        """The ranks agreed to stop after this micro-batch (a preemption signal, launcher/train/preempt.py): commit its
        checkpoint (with the open window, if inside one), then rank 0 requeues the SLURM job, which resumes by
        itself. The worker then exits 0: a preempted run is not a failed one (torchrun would restart it); in an
        elastic run it exits non-zero instead (launcher/worker.py), so that its agent joins the re-formed group."""
        self.preempted = True
        path = self.checkpointer.save("preempt")  # a no-op when this step is saved already (on_step)
        if self.rank != 0:
            return
        self.metrics.close()
        if self.trackers is not None:
            self.trackers.close(preempted=True)
        inside = f"; inside a window, after micro-batch {self.engine.micro_in_epoch} of epoch " \
                 f"{self.engine.epoch_index}" if self.engine.window_open else ""
        # Said before the requeue: SLURM may end this job step as soon as scontrol requeue returns.
        print(f"accum-sched: preempted at step {self.engine.optimizer_steps}: checkpoint saved "
              f"({path}{inside})", flush=True)
        print(f"accum-sched: {'job requeued' if requeue() else 'not requeued'}", flush=True)

    def final_state_dict(self) -> dict | None:
        """The trained model on rank 0 (None elsewhere); collective where the back end shards it."""
        return self.backend.final_state_dict(self.setup, self.rank)

    def finish(self) -> None:
        self.checkpointer.wait()  # the checkpoint in flight (checkpoint.async) is committed before the run is done
        if self.early_stopped and self.rank == 0:
            print(f"accum-sched: early stop: {self.cfg.eval.monitor} did not improve in "
                  f"{self.validation.bad} evaluations", flush=True)
        state = self.final_state_dict()
        counters = self.engine.counters()
        if self.rank != 0:
            return
        training = self._training_summary(counters)  # before the model is written: training time only
        path = os.path.join(self.run_dir, "model.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        if self.task.save_fn is not None:  # the task's own export (e.g. a save_pretrained directory)
            self.task.save_fn(state, self.run_dir)
        last = self.engine.last_step
        summary = {  # compile_stats: run.compile's summary fields (null when eager)
            "world_size": self.world, "epochs": self.cfg.run.epochs, "completed_epochs": self.engine.epoch_index,
            "optimizer_steps": counters["optimizer_steps"], "skipped_steps": counters["skipped_steps"],
            "overflow_steps": counters["overflow_steps"],
            "micro_batches": counters["micro_batches"],
            "micro_batches_all_ranks": counters["micro_batches"] * self.world,
            "elements": counters["elements"], "samples": counters["samples"],
            "allreduce_rounds": counters["allreduce_rounds"], "final_loss": None if last is None else last.loss,
            "final_factor": counters["factor"], "effective_batch": counters["effective_batch"],
            "stop_poll_every": counters["stop_poll_every"],  # the interval the poll's time floor chose last
            "wall_seconds": round(time.time() - self.start, 3), "backend": self.cfg.distributed.backend,
            "stopped_early": bool((self.engine.should_stop and not self._reached_max_steps()) or self.early_stopped),
            **compile_stats(self.model), **training,
        }
        if self.validation is not None:
            summary.update(self.validation.summary())
        atomic_write_json(os.path.join(self.run_dir, "summary.json"), summary)
        if self.trackers is not None:
            self.trackers.finish(summary)
        self.metrics.close()
        print(f"accum-sched: done: {summary['optimizer_steps']} optimizer steps, final loss "
              f"{summary['final_loss']:.4f}, {summary['wall_seconds']:.1f}s", flush=True)
        self._print_where_outputs_are()

    def _training_summary(self, counters: dict) -> dict:
        """summary.json's speed fields: the run's training seconds (a resume's earlier sessions included, like
        metrics.jsonl's elapsed_s), mean throughput = totals / those seconds, and each completed epoch's wall-clock."""
        elapsed = max(round(self.throughput.elapsed(), 3), 1e-3)  # the rates are of the seconds written
        return {"elapsed_s": elapsed, "samples_per_s": round(counters["samples"] / elapsed, 3),
                "tokens_per_s": round(counters["elements"] / elapsed, 3) if self.throughput.tokens else None,
                "epoch_seconds": epoch_seconds(read_jsonl(self.metrics.path), self.engine.epoch_index)}

    def _print_where_outputs_are(self) -> None:
        """The run's last lines: its directory (absolute: the run may have been started from anywhere), the files
        in it, and the command that shows the report."""
        run_dir = os.path.abspath(self.run_dir)
        files = [name for name in ("metrics.jsonl", "summary.json", "model.pt", "eval.jsonl")
                 if os.path.exists(os.path.join(run_dir, name))]
        print(f"accum-sched: outputs in {run_dir}: {', '.join(files)}", flush=True)
        print(report_line(run_dir), flush=True)
