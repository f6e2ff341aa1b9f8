"""A NaN loss on one rank inside an accumulated window (factor 3), for every back end: one process, DDP, FSDP2 (both
gradient-sync modes) and DeepSpeed ZeRO 0 and 2 (fp32), on 2 real gloo processes.

The NaN enters at a micro-batch in the middle of a window (not its boundary), so it sits in the accumulated local
gradient of one rank only until the boundary's collective spreads it. ``nonfinite="skip"``: every rank skips that
window's step, counts it, clears the poisoned gradient, and the next window steps normally, i.e. every rank's
parameters equal the plain-torch large-batch reference that takes no step for that window (momentum untouched).
``nonfinite="raise"``: every rank raises FloatingPointError naming the step, within the launch's deadline (no hang).
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch
from torch import nn

import cases
from accum_sched import AccumulationSchedule
from distributed import attempt, spawn

CASE = cases.Case("nonfinite", {0: 2, 1: 3}, epochs=2, samples=(40, 38))  # 10 micro-batches a rank, short last one
NAN_AT = (1, 4)  # (epoch, micro-batch) of the NaN: micro-batch 4 of epoch 1 is the middle of window [3, 4, 5]
NAN_WINDOW = (1, 1)  # (epoch, window index) it poisons
NAN_STEP = 5 + 2  # epoch 0 takes 5 steps (10 / 2), then window 1 of epoch 1
STEPS = 5 + 4  # epoch 1: windows of 3, 3, 3 and a partial one of 1
NAN_RANK = 1  # of 2; in one process, rank 0
DEADLINE_S = 300  # a rank that hangs on a collective fails the launch instead of waiting for gloo's 30 minutes
TORCH_RUNS = ("ddp", "fsdp/boundary", "fsdp/every_micro_batch")
DS_STAGES = (0, 2)


def nan_loss_fn(rank: int, nan_rank: int):
    """The regression loss, NaN on ``nan_rank`` at NAN_AT; ``seen["epoch"]`` is set by the loop."""
    base = cases.loss_fn_for(CASE.kind)
    seen = {"epoch": 0, "index": 0}

    def loss_fn(model, batch):
        loss_sum, n = base(model, batch)
        if rank == nan_rank and (seen["epoch"], seen["index"]) == NAN_AT:
            loss_sum = loss_sum * float("nan")
        seen["index"] += 1
        return loss_sum, n

    return loss_fn, seen


def train(engine, rank: int, nan_rank: int) -> dict:
    """Run CASE through ``engine``; what the test judges (full parameters are read by the caller)."""
    skipped = []
    engine.on_step(lambda info: skipped.append(info.step) if info.skipped else None)
    loss_fn, seen = nan_loss_fn(rank, nan_rank)
    for epoch in range(CASE.epochs):
        seen.update(epoch=epoch, index=0)
        engine.train_epoch(cases.rank_batches(CASE, rank, epoch), loss_fn, epoch)
    return {"skipped": skipped, "counters": engine.counters()}


def reference(world: int, skip=(NAN_WINDOW,)) -> list[torch.Tensor]:
    """cases.window_reference: the NaN window takes no optimizer step (its data is consumed, the momentum buffer is
    not touched)."""
    return cases.params(cases.window_reference(CASE, world, skip=skip)[0])


def assert_params(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=lambda m, i=i: f"{what} param {i}: {m}")


def assert_skipped_once(run: dict, what: str) -> None:
    assert run["error"] is None, (what, run["error"])
    result = run["result"]
    assert result["skipped"] == [NAN_STEP], (what, result)
    counters = result["counters"]
    assert counters["skipped_steps"] == 1 and counters["optimizer_steps"] == STEPS, (what, counters)


def assert_raised(run: dict, what: str) -> None:
    error = run["error"]
    assert error is not None and error[0] == "FloatingPointError", (what, run)
    assert f"step {NAN_STEP}" in error[1] and "nonfinite='skip'" in error[1], (what, error)


def test_reference_skip_matters():
    """Skipping the window moves the reference by far more than the tolerance, so the comparisons can fail."""
    for world in (1, 2):
        gap = max((a - b).abs().max().item() for a, b in zip(reference(world), reference(world, skip=())))
        assert gap > 1e-3, (world, gap)


# -- one process ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ("skip", "raise"))
def test_single_process_nan_in_a_window(mode):
    from accum_sched import AccumulationEngine

    model = cases.make_model(CASE)
    engine = AccumulationEngine(model, cases.make_optimizer(CASE, model), CASE.schedule, nonfinite=mode)
    run = attempt(lambda: train(engine, 0, 0))
    if mode == "raise":
        assert_raised(run, "one process")
        return
    assert_skipped_once(run, "one process")
    assert_params(cases.params(model), reference(1), "one process")


# -- DDP and FSDP2 on 2 ranks ---------------------------------------------------------------------------------------
def shard(model: nn.Module) -> nn.Module:
    """fully_shard every Linear, then the root (as the launcher's fsdp.wrap: [Linear])."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for module in list(model.modules())[1:]:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _torch_run(name: str, rank: int, mode: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    model = cases.make_model(CASE)
    if name == "ddp":
        wrapped, kwargs = DDP(model), {}
    else:
        wrapped, kwargs = shard(model), {"gradient_sync": name.split("/")[1]}
    optimizer = cases.make_optimizer(CASE, wrapped)
    engine = AccumulationEngine(wrapped, optimizer, CASE.schedule, nonfinite=mode, **kwargs)
    run = attempt(lambda: train(engine, rank, NAN_RANK))
    if mode == "skip":  # this rank's view of the full parameters (FSDP2: a collective, every rank gathers)
        run["params"] = cases.params(model) if name == "ddp" else [p.full_tensor().detach().clone()
                                                                    for p in wrapped.parameters()]
    return run


def _torch_worker(rank: int, world: int, out: str) -> None:
    warnings.simplefilter("ignore")
    runs = {f"{name}/{mode}": _torch_run(name, rank, mode) for name in TORCH_RUNS for mode in ("skip", "raise")}
    torch.save(runs, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite-torch")
    spawn(_torch_worker, 2, str(out), deadline_s=DEADLINE_S)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", TORCH_RUNS)
@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_on_every_rank(torch_runs, name):
    want = reference(2)
    for rank, runs in enumerate(torch_runs):
        run = runs[f"{name}/skip"]
        assert_skipped_once(run, f"{name} rank {rank}")
        assert_params(run["params"], want, f"{name} rank {rank}")


@pytest.mark.parametrize("name", TORCH_RUNS)
@pytest.mark.slow
def test_nan_on_one_rank_raises_on_every_rank(torch_runs, name):
    for rank, runs in enumerate(torch_runs):
        assert_raised(runs[f"{name}/raise"], f"{name} rank {rank}")


# -- DeepSpeed ZeRO 0 and 2 on 2 ranks ------------------------------------------------------------------------------
def ds_config(stage: int) -> dict:
    factor = AccumulationSchedule(CASE.schedule).factor_at(0)
    return {"train_micro_batch_size_per_gpu": CASE.micro, "gradient_accumulation_steps": factor,
            "train_batch_size": CASE.micro * factor * 2, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "gradient_clipping": 0.0}  # DeepSpeed clips at 1.0 unless told otherwise


def _ds_run(stage: int, rank: int, mode: str) -> dict:
    import deepspeed

    from accum_sched import AccumulationEngine

    model = cases.make_model(CASE)
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=cases.make_optimizer(CASE, model),
                                         config=ds_config(stage))
    engine = AccumulationEngine(ds_engine, None, CASE.schedule, nonfinite=mode)
    run = attempt(lambda: train(engine, rank, NAN_RANK))
    # ZeRO 0 and 2 keep full fp32 parameters in the module (ZeRO 2 gathers the updated partitions after each step)
    run["params"], run["global_steps"] = cases.params(model), ds_engine.global_steps
    return run


def _ds_worker(rank: int, world: int, out: str) -> None:
    import logging

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed insists on it
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    runs = {f"z{stage}/{mode}": _ds_run(stage, rank, mode) for stage in DS_STAGES for mode in ("skip", "raise")}
    torch.save(runs, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install -e .[deepspeed])")
    from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ensure_torch_extensions_dir()
    out = tmp_path_factory.mktemp("nonfinite-deepspeed")
    spawn(_ds_worker, 2, str(out), deadline_s=DEADLINE_S)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("stage", DS_STAGES)
def test_deepspeed_nan_on_one_rank_is_skipped_on_every_rank(ds_runs, stage):
    want = reference(2)
    for rank, runs in enumerate(ds_runs):
        run = runs[f"z{stage}/skip"]
        assert_skipped_once(run, f"ZeRO {stage} rank {rank}")
        assert run["global_steps"] == STEPS  # DeepSpeed's own count: one per window, the skipped one included
        assert_params(run["params"], want, f"ZeRO {stage} rank {rank}")


@pytest.mark.parametrize("stage", DS_STAGES)
def test_deepspeed_nan_on_one_rank_raises_on_every_rank(ds_runs, stage):
    for rank, runs in enumerate(ds_runs):
        assert_raised(runs[f"z{stage}/raise"], f"ZeRO {stage} rank {rank}")
