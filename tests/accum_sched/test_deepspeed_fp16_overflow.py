"""DeepSpeed fp16: an overflowing window is a counted skip that holds every LR scheduler, as the torch GradScaler
path does (issue 26.5), and ``nonfinite='raise'`` does not raise for it (an overflow is dynamic loss scaling at
work, not a non-finite fp32 gradient).

Two ranks, ZeRO-2 with the LR scheduler handed to DeepSpeed (DeepSpeed steps it) and ZeRO-3 with the scheduler
handed to the engine (the back end steps it). The initial loss scale 2**20 overflows for the first windows and backs
off. The test records which windows were skipped (from the steps the engine reports) and checks every rank's
weights against the plain-torch large-batch reference that skips those windows and does not step its scheduler
there: an LR scheduler stepped on an overflow would put every later window at another learning rate (decay 0.8 per
step), far outside the fp16 tolerance.

fp16 on CPU: as in test_gpu_readiness.py, the workers claim the accelerator's fp16 capability (DeepSpeed's CPU
accelerator asks oneDNN, which has no fp16 kernels here) and run DeepSpeed's real fp16 optimizers and loss scaler.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import cases
from distributed import spawn

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed (pip install -e .[deepspeed])"),
              pytest.mark.slow]  # the slow tier (docs/testing.md)

CASE = cases.CASES[0]  # sgd, factors 1..5 over 6 epochs, partial windows
DECAY = 0.8


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: DECAY ** k)


def _train(rank: int, stage: int, scheduler_owner: str) -> dict:
    import deepspeed

    from accum_sched import AccumulationEngine
    from accum_sched.backends.deepspeed import consolidated_state_dict

    model = cases.make_model(CASE)
    optimizer = cases.make_optimizer(CASE, model)
    scheduler = _scheduler(optimizer)
    config = {"train_micro_batch_size_per_gpu": CASE.micro, "gradient_accumulation_steps": 1,
              "train_batch_size": CASE.micro * 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "initial_scale_power": 20}}
    ds, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                       lr_scheduler=scheduler if scheduler_owner == "deepspeed" else None)
    engine = AccumulationEngine(ds, None, CASE.schedule, precision="fp16", micro_batch_size=CASE.micro,
                                nonfinite="raise", lr_scheduler=scheduler if scheduler_owner == "engine" else None)
    windows: list[tuple[int, bool]] = []  # (epoch, skipped) of every step the engine reported, in order
    engine.on_step(lambda info: windows.append((info.epoch, info.skipped)))
    plain = cases.loss_fn_for(CASE.kind)

    def loss_fn(model, batch):
        return plain(model, (batch[0].half(), batch[1].half()))

    for epoch in range(CASE.epochs):
        engine.train_epoch(cases.rank_batches(CASE, rank, epoch), loss_fn, epoch)
    return {"state": consolidated_state_dict(ds, rank0_only=False), "windows": windows,
            "overflow": engine.overflow_steps, "skipped": engine.skipped_steps, "steps": engine.optimizer_steps,
            "scheduler_steps": scheduler.last_epoch, "lr": optimizer.param_groups[0]["lr"]}


def _worker(rank: int, world: int, out: str) -> None:
    import logging
    import warnings

    os.environ["LOCAL_RANK"] = str(rank)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    type(get_accelerator()).is_fp16_supported = lambda self: True  # see the module docstring
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = {"z2/deepspeed": _train(rank, 2, "deepspeed"), "z3/engine": _train(rank, 3, "engine")}
    torch.save(runs, os.path.join(out, f"overflow-{rank}.pt"))


def _skipped_windows(windows: list[tuple[int, bool]]) -> set[tuple[int, int]]:
    """(epoch, index in epoch) of the skipped windows, from the steps in the order the engine reported them."""
    out, index, last = set(), 0, None
    for epoch, skipped in windows:
        index = index + 1 if epoch == last else 0
        last = epoch
        if skipped:
            out.add((epoch, index))
    return out


def test_deepspeed_fp16_overflow_skips_without_stepping_any_lr_scheduler(tmp_path):
    from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ensure_torch_extensions_dir()
    spawn(_worker, 2, str(tmp_path), deadline_s=900)
    ranks = [torch.load(tmp_path / f"overflow-{rank}.pt", weights_only=False) for rank in range(2)]
    start = cases.make_model(CASE).state_dict()
    for name in ("z2/deepspeed", "z3/engine"):
        skip = _skipped_windows(ranks[0][name]["windows"])
        want, _ = cases.window_reference(CASE, 2, scheduler=_scheduler, skip=skip, hold_lr=True)
        want = want.state_dict()
        for rank, runs in enumerate(ranks):
            run = runs[name]
            assert run["windows"] == ranks[0][name]["windows"], (name, rank)  # the same skips on every rank
            # an overflow is counted as such and as a skip, and the scale 2**20 must overflow at least once here
            assert run["overflow"] == run["skipped"] == len(skip) >= 1, (name, rank, run["overflow"], run["skipped"])
            assert run["steps"] == len(run["windows"]), (name, rank)
            # the LR schedule waited at every overflow: one scheduler step per window that stepped
            assert run["scheduler_steps"] == run["steps"] - run["overflow"], (name, rank, run["scheduler_steps"])
            assert run["lr"] == pytest.approx(CASE.lr * DECAY ** (run["steps"] - run["overflow"])), (name, rank)
            for key in want:
                moved = (want[key] - start[key]).abs().max().item()
                gap = (run["state"][key] - want[key]).abs().max().item()
                # fp16 weights and activations (test_gpu_readiness.py measured <= 6e-4 for exact windows)
                assert gap < 3e-3 and gap < moved / 20, (name, rank, key, gap, moved)
