"""The trainer's validation: when to evaluate, eval.jsonl, the best model, early stopping, and their resume state.

Every decision here (is this the best value, stop now?) is taken on every rank from the all-reduced numbers that
`launcher.train.evaluate.evaluate` returns, so the ranks agree without another collective.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from accum_sched import collective
from launcher.errors import ConfigError
from launcher.train import streams
from launcher.train.evaluate import evaluate

EVAL_FILE = "eval.jsonl"
BEST_FILE = "model-best.pt"


class Validation:
    """Built by the worker when the task has a ``val_dataset``. ``state_fn()`` returns the model state to save as
    model-best.pt on rank 0 (None elsewhere); it is collective under DeepSpeed and FSDP2, so it is called on every
    rank."""

    def __init__(self, cfg, task, model, device, rank: int, autocast, move, state_fn, run_dir: str, start: float):
        self.section, self.task, self.model, self.device = cfg.eval, task, model, device
        self.rank, self.autocast, self.move, self.state_fn = rank, autocast, move, state_fn
        self.micro = cfg.eval.micro_batch_size or cfg.data.micro_batch_size
        self.path = os.path.join(run_dir, EVAL_FILE)
        self.best_path = os.path.join(run_dir, BEST_FILE)
        self.start = start
        self.dataset = task.val_dataset
        if streams.is_stream(self.dataset):  # this rank's share, as the training stream is sharded (data.shard)
            self.dataset = streams.ShardedStream(self.dataset, rank, collective.world_size(),
                                                 split=cfg.data.shard == "auto")
        stop = cfg.eval.early_stop
        self.patience = None if stop is None else int(stop["patience"])
        self.min_delta = 0.0 if stop is None else float(stop.get("min_delta", 0.0))
        # resume state (see state_dict)
        self.best: dict | None = None  # the eval.jsonl record of the best evaluation so far
        self.last: dict | None = None
        self.bad = 0  # evaluations in a row without improvement
        self.stop = False

    # -- when ---------------------------------------------------------------------------------------------------
    def due_after_epoch(self, epoch: int, step: int) -> bool:
        n = self.section.every_n_epochs
        already = self.last is not None and self.last["step"] == step  # a step-triggered one just ran
        return n is not None and (epoch + 1) % n == 0 and not already

    def due_after_step(self, step: int) -> bool:
        n = self.section.every_n_steps
        return n is not None and step % n == 0

    # -- one evaluation -----------------------------------------------------------------------------------------
    def run(self, epoch: int, step: int) -> dict:
        """Evaluate, log, keep the best model, update the early-stop count. Collective."""
        task = self.task
        result = evaluate(self.model, self.dataset, task.val_loss_fn or task.loss_fn,
                          micro_batch_size=self.micro, collate_fn=task.collate_fn, metrics_fn=task.metrics_fn,
                          move=self.move, autocast=self.autocast, device=self.device)
        monitor = self.section.monitor
        if monitor not in result:
            raise ConfigError("eval.monitor", f"{monitor!r} is not among the evaluation's values "
                              f"({', '.join(result)})", "monitor val_loss or a name metrics_fn returns")
        record = {"epoch": epoch, "step": step, **result, "wall_time": round(time.time() - self.start, 4)}
        improved = self._improves(record[monitor])
        if improved:
            self.best, self.bad = record, 0
            state = self.state_fn()
            if self.rank == 0:
                torch.save(state, self.best_path + ".tmp")
                os.replace(self.best_path + ".tmp", self.best_path)
        else:
            self.bad += 1
        self.last = record
        self.stop = self.patience is not None and self.bad >= self.patience
        if self.rank == 0:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        best = self.best[self.section.monitor]
        if self.section.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    # -- summary and resume -------------------------------------------------------------------------------------
    def summary(self) -> dict:
        return {"last_eval": self.last, "best_eval": self.best, "eval_monitor": self.section.monitor,
                "eval_mode": self.section.mode}

    def state_dict(self) -> dict:
        return {"best": self.best, "last": self.last, "bad": self.bad}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.best, self.last, self.bad = state.get("best"), state.get("last"), int(state.get("bad", 0))
            self.stop = self.patience is not None and self.bad >= self.patience

    def truncate(self, step: int) -> None:
        """Rank 0: keep the eval.jsonl lines of steps <= ``step`` (0 for a fresh run), as metrics.jsonl is cut."""
        if self.rank != 0 or not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            kept = []
            for line in f:
                try:
                    if int(json.loads(line).get("step", 0)) <= step and step > 0:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, AttributeError):
                    continue
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
