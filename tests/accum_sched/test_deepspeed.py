"""DeepSpeed back end: ZeRO 0-3 runs equal the plain-torch large-batch reference and the DDP back end.

One launch of 2 real gloo processes (DeepSpeed's CPU accelerator) trains every run below; each rank saves what it
sees (the consolidated state and its own working weights: full ones, or its ZeRO 3 partition), and the tests compare
every rank with the reference and the ranks with each other. DeepSpeed start-up is slow, so everything shares that
one launch.

Tolerance: atol 1e-6 / rtol 1e-5 on float32 parameters, as for DDP. What remains is reduction order: ZeRO 2/3
average every micro-batch's gradient into the partition while the reference sums one large batch; the measured gap
is <= 2e-7. A wrong normalisation (DeepSpeed's 1/GAS, the window's micro-batch count, its default
gradient_clipping of 1.0) moves parameters by 1e-3 or more.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import warnings

import pytest
import torch

import cases
from accum_sched import AccumulationSchedule, window_stats
from counters import CollectiveCounter
from distributed import spawn

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

if importlib.util.find_spec("deepspeed") is None:  # not imported here: the fixture sets DS_ACCELERATOR first
    pytest.skip("deepspeed is not installed (pip install -e .[deepspeed])", allow_module_level=True)

WORLD = 2
STAGES = (0, 1, 2, 3)
BY_NAME = {c.name: c for c in cases.CASES}
# changing schedule + partial windows + momentum; AdamW + engine clipping; an epoch shorter than the factor;
# per-token normalisation; a parameter that gets no gradient
EXACT_CASES = ("sgd-changing-partial", "adamw-clip", "sgd-clip-short-epoch", "tokens-adamw", "unused-params")
DS_OPT = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}
DS_SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.002, "warmup_max_lr": 0.01, "warmup_num_steps": 6,
                                           "warmup_type": "linear"}}
COUNTED_CLIP = 0.5  # the counted runs clip, so the norm is wanted at every step
NAN_AT = (0, 1)  # (epoch, micro-batch) whose loss is NaN on rank 1: the first window of factor 1 at epoch 0


def ds_config(case, stage: int, **extra) -> dict:
    factor = AccumulationSchedule(case.schedule).factor_at(0)
    config = {"train_micro_batch_size_per_gpu": case.micro, "gradient_accumulation_steps": factor,
              "train_batch_size": case.micro * factor * WORLD, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              # DeepSpeed clips at 1.0 unless told otherwise; the engine's max_grad_norm is the clipping under test
              "gradient_clipping": 0.0}
    config.update(extra)
    return config


def _nan_loss(loss_fn, rank: int):
    seen = {"epoch": None, "i": 0}

    def wrapped(model, batch):
        loss, n = loss_fn(model, batch)
        if rank == 1 and (seen["epoch"], seen["i"]) == NAN_AT:
            loss = loss * float("nan")
        seen["i"] += 1
        return loss, n

    return wrapped, seen


def _train_ds(case, rank: int, stage: int, *, config: dict | None = None, client_optimizer: bool = True,
              precision: str = "fp32", clip=None, nan: bool = False, count: bool = False, **engine_kwargs) -> dict:
    import deepspeed

    from accum_sched import AccumulationEngine
    from accum_sched.backends.deepspeed import consolidated_state_dict

    model = cases.make_model(case)
    kwargs = {"optimizer": cases.make_optimizer(case, model)} if client_optimizer else {
        "model_parameters": model.parameters()}
    ds_engine, *_ = deepspeed.initialize(model=model, config=config or ds_config(case, stage), **kwargs)
    engine = AccumulationEngine(ds_engine, None, case.schedule, max_grad_norm=clip, precision=precision,
                                **engine_kwargs)
    steps, collectives = [], []
    engine.on_step(steps.append)
    loss_fn, seen = _nan_loss(cases.loss_fn_for(case.kind), rank) if nan else (cases.loss_fn_for(case.kind), None)
    # count: every collective launched while training, listed per optimizer step (the tests' own count,
    # tests/counters.py)
    with CollectiveCounter() if count else contextlib.nullcontext() as counter:
        if counter is not None:
            engine.on_step(lambda info: collectives.append(  # (name, numel, group) since the step before
                [(*call, group) for call, group in zip(counter.calls, counter.groups)][sum(map(len, collectives)):]))
        for epoch in range(case.epochs):
            if seen is not None:
                seen.update(epoch=epoch, i=0)
            engine.train_epoch(cases.rank_batches(case, rank, epoch), loss_fn, epoch)
    return {"state": consolidated_state_dict(ds_engine, rank0_only=False),
            "local": cases.deepspeed_local_weights(ds_engine), "optimizer": type(ds_engine.optimizer).__name__,
            "steps": [s.to_dict() for s in steps], "counters": engine.counters(), "collectives": collectives,
            "ds": {"global_steps": ds_engine.global_steps, "global_samples": ds_engine.global_samples,
                   "gas": ds_engine.gradient_accumulation_steps(), "train_batch_size": ds_engine.train_batch_size()}}


def _deepspeed_own_accumulation(case, rank: int) -> dict:
    """What a DeepSpeed user does today: set_train_batch_size per epoch, mean losses, step() every micro-batch."""
    import deepspeed

    model = cases.make_model(case)
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=cases.make_optimizer(case, model),
                                         config=ds_config(case, 0))
    schedule = AccumulationSchedule(case.schedule)
    for epoch in range(case.epochs):
        ds_engine.set_train_batch_size(case.micro * schedule.factor(epoch) * WORLD)
        for batch in cases.rank_batches(case, rank, epoch):
            loss, n = cases.loss_fn_for(case.kind)(ds_engine, batch)
            ds_engine.backward(loss / n)
            ds_engine.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _guard_checks(rank: int) -> dict:
    """DeepSpeed internals the back end relies on, changed on a real engine: one-line errors naming the version."""
    import deepspeed

    from accum_sched import AccumulationEngine
    from accum_sched.backends.deepspeed import DeepSpeedInternalsChanged

    sgd = BY_NAME["sgd-changing-partial"]
    out = {}

    def fresh():
        model = cases.make_model(sgd)
        ds_engine, *_ = deepspeed.initialize(model=model, optimizer=cases.make_optimizer(sgd, model),
                                             config=ds_config(sgd, 2))
        return ds_engine

    ds_engine = fresh()
    del ds_engine.optimizer.averaged_gradients  # an attribute the back end reads is gone: stop at set-up
    try:
        AccumulationEngine(ds_engine, None, sgd.schedule)
        out["attribute"] = None
    except DeepSpeedInternalsChanged as exc:
        out["attribute"] = str(exc)
    ds_engine = fresh()
    engine = AccumulationEngine(ds_engine, None, sgd.schedule, max_grad_norm=1.0)
    opt = ds_engine.optimizer  # the gradient partition no longer matches the master partition: stop at step 1
    opt.single_partition_of_fp32_groups = [t[:-1] for t in opt.single_partition_of_fp32_groups]
    try:
        engine.train_epoch(cases.rank_batches(sgd, rank, 0), cases.loss_fn_for(sgd.kind), 0)
        out["shape"] = None
    except DeepSpeedInternalsChanged as exc:
        out["shape"] = str(exc)
    out["steps_before_shape_error"] = engine.optimizer_steps
    out["version"] = deepspeed.__version__
    return out


def _worker(rank: int, world: int, out: str) -> None:
    import logging

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed insists on it (torchrun and the deepspeed launcher set it)
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in EXACT_CASES:
            case = BY_NAME[name]
            model, engine = cases.run_engine(case, rank, world)  # the DDP back end, same processes
            runs[f"ddp/{name}"] = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
            for stage in STAGES:
                runs[f"z{stage}/{name}"] = _train_ds(case, rank, stage, clip=case.clip)
        adamw = BY_NAME["adamw-clip"]
        # DeepSpeed's own gradient_clipping (instead of the engine's) acts on the normalised gradient: still exact
        runs["z2/ds-clipping"] = _train_ds(adamw, rank, 2, config=ds_config(adamw, 2, gradient_clipping=adamw.clip))
        # DeepSpeed's JSON optimizer and scheduler sections (stepped by DeepSpeed, once per optimizer step)
        sgd = BY_NAME["sgd-changing-partial"]
        runs["z1/ds-optimizer"] = _train_ds(sgd, rank, 1, client_optimizer=False,
                                            config=ds_config(sgd, 1, optimizer=DS_OPT, scheduler=DS_SCHED))
        # a non-finite loss on one rank: the step is skipped everywhere (our no-op step / ZeRO's overflow path)
        for stage in (0, 2, 3):
            runs[f"z{stage}/nan"] = _train_ds(sgd, rank, stage, nan=True)
        clipped = dataclasses.replace(sgd, clip=COUNTED_CLIP)
        for stage in (0, 2):  # collectives per step, counted outside the engine
            runs[f"z{stage}/counted"] = _train_ds(clipped, rank, stage, clip=clipped.clip, count=True)
        # bf16 weights: no ZeRO (FP16_UnfusedOptimizer), ZeRO 1 with fp32 accumulation (BF16_Optimizer), ZeRO 2/3
        fp32_accum = {"data_types": {"grad_accum_dtype": "fp32"}}
        for stage, extra in ((0, {}), (1, fp32_accum), (2, {}), (3, fp32_accum)):
            runs[f"z{stage}/bf16"] = _train_ds(sgd, rank, stage, precision="bf16",
                                               config=ds_config(sgd, stage, bf16={"enabled": True}, **extra))
        # LR coupling (lr x factor ratio for the update only): DeepSpeed's scheduler never sees the scaled LR
        model, _ = cases.run_engine(sgd, rank, world, lr_coupling="linear")
        runs["ddp/lr-coupling"] = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        runs["z2/lr-coupling"] = _train_ds(sgd, rank, 2, lr_coupling="linear")
        runs["negative/ds-own-accumulation"] = _deepspeed_own_accumulation(sgd, rank)
        # schedules keyed by optimizer steps and by tokens (issue 8): the factor changes mid-epoch, at boundaries
        for case, unit, coupling in cases.UNIT_CASES[:2]:
            keyed = dataclasses.replace(case, schedule=AccumulationSchedule(case.schedule, unit))
            for stage in (0, 2, 3):
                runs[f"z{stage}/{unit}-keyed"] = _train_ds(keyed, rank, stage, clip=case.clip, lr_coupling=coupling)
        runs["guard"] = _guard_checks(rank)
    torch.save(runs, os.path.join(out, f"runs-{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's runs, indexed by rank."""
    from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ensure_torch_extensions_dir()  # DeepSpeed JIT-compiles a shared-memory op on first use; cache it across runs
    out = tmp_path_factory.mktemp("deepspeed")
    spawn(_worker, WORLD, str(out))
    return [torch.load(out / f"runs-{rank}.pt", weights_only=False) for rank in range(WORLD)]


def reference(case, *, optimizer=None, scheduler=None, skip=()) -> dict:
    """cases.window_reference on this file's world: the final state and the LR of every window."""
    model, lrs = cases.window_reference(case, WORLD, optimizer=optimizer, scheduler=scheduler, skip=skip)
    return {"state": model.state_dict(), "lrs": lrs}


def assert_params_close(got: dict, want: dict, what: str, atol=1e-6, rtol=1e-5) -> float:
    assert list(got) == list(want), what
    gap = 0.0
    for key in want:
        assert got[key].dtype == torch.float32, (what, key, got[key].dtype)  # a plain fp32 state_dict at every stage
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=rtol, msg=lambda m: f"{what} {key}: {m}")
        gap = max(gap, (got[key] - want[key]).abs().max().item())
    return gap


def assert_every_rank_close(ranks: list[dict], key: str, want: dict, what: str, **tol) -> None:
    """Every rank's consolidated state and its own working weights (full, or its ZeRO 3 partition) equal ``want``;
    full working weights are bitwise the same on every rank."""
    for rank, runs in enumerate(ranks):
        run = runs[key]
        assert_params_close(run["state"], want, f"{what}, rank {rank}", **tol)
        assert run["local"] and set(run["local"]) <= set(want), (what, rank, list(run["local"]))
        for name, (values, start) in run["local"].items():
            expected = want[name].reshape(-1)[start:start + values.numel()]
            torch.testing.assert_close(values, expected, atol=tol.get("atol", 1e-6), rtol=tol.get("rtol", 1e-5),
                                       msg=lambda m, r=rank, n=name: f"{what}, rank {r}'s own {n}: {m}")
            mine, first = values, ranks[0][key]["local"][name][0]
            if start == 0 and ranks[0][key]["local"][name][1] == 0:  # full weights on both: one model
                assert torch.equal(mine, first), (what, rank, name)


def _moved(case, state) -> float:
    start = cases.make_model(case).state_dict()
    return max((state[k] - start[k]).abs().max().item() for k in start)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_equals_reference_and_ddp(ranks, stage):
    expected_optimizer = {0: "SGD", 1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer",
                          3: "DeepSpeedZeroOptimizer_Stage3"}[stage]
    for name in EXACT_CASES:
        case = BY_NAME[name]
        ref = reference(case)
        assert _moved(case, ref["state"]) > 1e-2  # training moved the reference
        assert_every_rank_close(ranks, f"z{stage}/{name}", ref["state"], f"ZeRO {stage} {name} vs reference")
        for rank, runs in enumerate(ranks):
            run = runs[f"z{stage}/{name}"]
            if name == "sgd-changing-partial":
                assert run["optimizer"] == expected_optimizer
            assert_params_close(runs[f"ddp/{name}"]["state"], ref["state"], f"DDP {name}, rank {rank}")
            assert_params_close(run["state"], runs[f"ddp/{name}"]["state"], f"ZeRO {stage} {name} vs DDP, rank {rank}")

            # DeepSpeed's own bookkeeping tells the truth: one optimizer step per window, real samples, current factor
            steps, counters, ds = run["steps"], run["counters"], run["ds"]
            schedule = AccumulationSchedule(case.schedule)
            last_factor = schedule.factor(case.epochs - 1)
            assert ds["global_steps"] == counters["optimizer_steps"] == len(steps)
            assert ds["global_samples"] == counters["samples"] == sum(s["samples"] for s in steps)
            assert ds["gas"] == last_factor and ds["train_batch_size"] == case.micro * last_factor * WORLD
            assert [s["factor"] for s in steps] == [schedule.factor(s["epoch"]) for s in steps]
            assert any(s["micro_batches"] < s["factor"] for s in steps)  # partial windows were exercised
            assert steps == ranks[0][f"z{stage}/{name}"]["steps"], (stage, name, rank)  # the same steps everywhere


@pytest.mark.parametrize("stage", (0, 2))
def test_small_collectives_per_step(ranks, stage):
    """No ZeRO: the window's numbers ride in DeepSpeed's own gradient all-reduce, so a step has no small collective
    (one at an epoch start: the agreement). ZeRO 2: one small all-reduce of ours per step, holding the numbers and
    the partition's squared norm together (clipping wants the norm)."""
    case = dataclasses.replace(BY_NAME["sgd-changing-partial"], clip=COUNTED_CLIP)
    assert_every_rank_close(ranks, f"z{stage}/counted", reference(case)["state"], f"ZeRO {stage} counted")
    for rank, runs in enumerate(ranks):
        run = runs[f"z{stage}/counted"]
        steps = run["steps"]
        assert len(run["collectives"]) == len(steps) > 0
        for i, (step, calls) in enumerate(zip(steps, run["collectives"])):
            epoch_start = i == 0 or steps[i - 1]["epoch"] != step["epoch"]
            small = [c for c in calls if c[1] <= 64]
            # ours go to the side group under gloo (the epoch's agreement, on the default group, is not one)
            numbers = [c for c in small if c[1] in (window_stats.SIZE, window_stats.SIZE + 1) and c[2] == "other"]
            assert len(numbers) == int(stage != 0), (stage, rank, i, calls)  # with the norm or not
            if stage == 0:  # DeepSpeed's ZeRO 2 adds small collectives of its own (its overflow flag), alone as well
                assert len(small) == int(epoch_start), (stage, rank, i, calls)
            assert any(n > 64 for _, n, _ in calls), (stage, rank, i, calls)  # the gradients' own were seen


def test_deepspeed_gradient_clipping_acts_on_the_normalised_gradient(ranks):
    case = BY_NAME["adamw-clip"]
    assert_every_rank_close(ranks, "z2/ds-clipping", reference(case)["state"], "gradient_clipping in the JSON")


def test_deepspeed_json_optimizer_and_scheduler(ranks):
    from deepspeed.runtime.lr_schedules import WarmupLR

    case = BY_NAME["sgd-changing-partial"]
    ref = reference(case, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01),
                    scheduler=lambda o: WarmupLR(o, **DS_SCHED["params"]))
    assert len(set(ref["lrs"])) > 3
    for runs in ranks:
        run = runs["z1/ds-optimizer"]
        assert run["optimizer"] == "DeepSpeedZeroOptimizer"
        assert [s["lr"] for s in run["steps"]] == pytest.approx(ref["lrs"], rel=1e-12)  # stepped once per window
    assert_every_rank_close(ranks, "z1/ds-optimizer", ref["state"], "DeepSpeed optimizer + scheduler")


@pytest.mark.parametrize("stage", (0, 2, 3))
def test_nonfinite_window_is_skipped_on_every_rank(ranks, stage):
    case = BY_NAME["sgd-changing-partial"]
    for runs in ranks:  # the NaN is rank 1's alone; every rank skips the same step
        run = runs[f"z{stage}/nan"]
        skipped = [s for s in run["steps"] if s["skipped"]]
        assert [(s["epoch"], s["step"]) for s in skipped] == [(0, 2)]  # micro-batch 1 of epoch 0 = window 1 (factor 1)
        assert run["ds"]["global_steps"] == len(run["steps"])
    assert_every_rank_close(ranks, f"z{stage}/nan", reference(case, skip={(0, 1)})["state"], f"ZeRO {stage} skip")


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_sanity(ranks, stage):
    """bf16 weights and bf16 compute cannot be exact; they must stay near the fp32 reference (1% of the movement)."""
    case = BY_NAME["sgd-changing-partial"]
    ref = reference(case)["state"]
    moved = _moved(case, ref)
    for rank, runs in enumerate(ranks):
        run = runs[f"z{stage}/bf16"]
        assert run["optimizer"] == {0: "FP16_UnfusedOptimizer", 1: "BF16_Optimizer", 2: "DeepSpeedZeroOptimizer",
                                    3: "DeepSpeedZeroOptimizer_Stage3"}[stage]
        gap = max((run["state"][k] - ref[k]).abs().max().item() for k in ref)
        assert all(v.dtype == torch.float32 for v in run["state"].values())
        assert gap < 0.02 * moved, (rank, gap, moved)
        for name, (values, start) in run["local"].items():  # this rank's own (bf16) weights, near the fp32 ones
            local_gap = (values - ref[name].reshape(-1)[start:start + values.numel()]).abs().max().item()
            assert local_gap < 0.02 * moved, (rank, name, local_gap, moved)


def test_lr_coupling_equals_ddp(ranks):
    case = BY_NAME["sgd-changing-partial"]
    want = ranks[0]["ddp/lr-coupling"]["state"]
    assert max((want[k] - reference(case)["state"][k]).abs().max().item() for k in want) > 1e-3  # coupling acted
    for rank, runs in enumerate(ranks):
        got = runs["z2/lr-coupling"]
        assert [s["lr"] for s in got["steps"]] == [case.lr * s["factor"] for s in got["steps"]]
        for k in want:  # DDP: one model on every rank
            assert torch.equal(runs["ddp/lr-coupling"]["state"][k], want[k]), (rank, k)
    assert_every_rank_close(ranks, "z2/lr-coupling", want, "LR coupling, ZeRO 2 vs DDP")


def test_deepspeed_own_accumulation_is_not_exact(ranks):
    """The comparison can fail: DeepSpeed's own boundaries and per-micro-batch means miss the reference."""
    case = BY_NAME["sgd-changing-partial"]
    ref = reference(case)["state"]
    for runs in ranks:
        got = runs["negative/ds-own-accumulation"]["state"]
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) > 1e-3


@pytest.mark.parametrize("stage", (0, 2, 3))
@pytest.mark.parametrize("unit_case", cases.UNIT_CASES[:2], ids=lambda c: c[1])
def test_step_and_token_keyed_schedules_equal_reference(ranks, stage, unit_case):
    case, unit, coupling = unit_case
    for runs in ranks:
        run = runs[f"z{stage}/{unit}-keyed"]
        assert len({s["factor"] for s in run["steps"]}) > 1  # the factor really changed
        assert any(s["factor"] != t["factor"] and s["epoch"] == t["epoch"]
                   for s, t in zip(run["steps"], run["steps"][1:]))
    ref = cases.reference_units(case, unit, coupling, WORLD)
    assert_every_rank_close(ranks, f"z{stage}/{unit}-keyed", ref.state_dict(), f"ZeRO {stage} {unit}-keyed")


def test_changed_deepspeed_internals_stop_with_one_line_naming_the_version(ranks):
    for rank, runs in enumerate(ranks):
        guard = runs["guard"]
        for what in ("attribute", "shape"):
            message = guard[what]
            assert message is not None, f"a changed {what} went unnoticed on rank {rank}"
            assert "\n" not in message and message.startswith(f"DeepSpeed {guard['version']}: "), message
        assert "averaged_gradients" in guard["attribute"]
        assert "single_partition_of_fp32_groups" in guard["shape"] and guard["steps_before_shape_error"] == 0
