"""Gradient noise scale and the adaptive factor, on real gloo processes (2 and 3 ranks) and in one process.

The measured inputs (gns_local_sq, gns_global_sq, gns_b_local, gns_b_global) are compared with a plain-torch
reference computed here: per window, each rank's own mean gradient over its elements and the global one, taken with
autograd on the reference model, which is trained with the window's global mean gradient. Adaptive runs: decisions
equal on every rank, changes only where the rule allows, resume mid-epoch repeats them bit for bit.
"""
from __future__ import annotations

import importlib.util
import io
import json
import math
import os

import pytest
import torch

import cases
import paths
from distributed import attempt, spawn

# partial windows: 10 micro-batches a rank (last one short and different per rank), factors 2 then 3 (3,3,3,1)
REG = cases.Case("gns-regression", {0: 2, 1: 3}, epochs=2, samples=(37, 39, 38))
# token counts differ per micro-batch and rank; clipping on (the inputs are taken before clipping)
TOK = cases.Case("gns-tokens", {0: 3}, epochs=2, samples=(26, 27, 25), kind="tokens", optimizer="adamw", clip=0.5)
ADAPT = cases.Case("adaptive", 1, epochs=4, samples=(40, 38, 39))
ADAPTIVE = {"min_factor": 1, "max_factor": 8, "every_n_steps": 2, "ema": 0.8, "hysteresis": 0.25}
STOP_AFTER = 3  # resume: stop requested after step 3, taken after step 4 (mid-epoch 1; a decision follows)
FIELDS = ("gns_local_sq", "gns_global_sq", "gns_b_local", "gns_b_global")
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _engine(case, model, world, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    wrapped = DDP(model) if world > 1 else model
    schedule = kwargs.pop("schedule", case.schedule)
    return AccumulationEngine(wrapped, cases.make_optimizer(case, model), schedule, max_grad_norm=case.clip,
                              **kwargs)


def _train(case, rank, world, engine, epochs=None, start=0):
    loss_fn = cases.loss_fn_for(case.kind)
    for epoch in range(start, case.epochs if epochs is None else epochs):
        engine.train_epoch(cases.rank_batches(case, rank, epoch), loss_fn, epoch)
        if engine.should_stop:
            break


def _ranks(rank: int, world: int, out_dir: str, resume: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    report = {}

    def measure(case, **kwargs):
        model = cases.make_model(case)
        engine = _engine(case, model, world, noise_scale=True, **kwargs)
        lines = []
        engine.on_step(lambda info: lines.append(info.to_dict()))
        _train(case, rank, world, engine)
        return {"lines": lines, "params": [p.tolist() for p in model.parameters()]}

    report["regression"] = attempt(lambda: measure(REG, micro_batch_size=REG.micro))  # prescaled losses
    report["tokens"] = attempt(lambda: measure(TOK))
    if resume:
        report["adascale"] = attempt(lambda: measure(ADAPT, schedule={0: 1, 1: 3}, lr_coupling="adascale"))

    def adaptive_run(stop_after=None):
        model = cases.make_model(ADAPT)
        engine = _engine(ADAPT, model, world, schedule=1, adaptive=dict(ADAPTIVE), micro_batch_size=ADAPT.micro)
        lines = []
        engine.on_step(lambda info: lines.append(info.to_dict()))
        if stop_after is not None:
            engine.on_step(lambda info: engine.request_stop() if info.step == stop_after else None)
        _train(ADAPT, rank, world, engine)
        return model, engine, lines

    def adaptive():
        model, engine, lines = adaptive_run()
        return {"lines": lines, "params": [p.tolist() for p in model.parameters()]}

    report["adaptive"] = attempt(adaptive)

    def resumed():
        model, engine, lines = adaptive_run(STOP_AFTER)
        buffer = io.BytesIO()
        torch.save({"engine": engine.state_dict(), "model": model.state_dict(),
                    "optimizer": engine.backend.optimizer.state_dict()}, buffer)
        stopped_at = [engine.epoch_index, engine.micro_in_epoch]
        buffer.seek(0)
        state = torch.load(buffer)
        model = cases.make_model(ADAPT)
        model.load_state_dict(state["model"])
        optimizer = cases.make_optimizer(ADAPT, model)
        optimizer.load_state_dict(state["optimizer"])
        engine = AccumulationEngine(DDP(model), optimizer, adaptive=dict(ADAPTIVE), micro_batch_size=ADAPT.micro)
        engine.load_state_dict(state["engine"])
        engine.on_step(lambda info: lines.append(info.to_dict()))
        _train(ADAPT, rank, world, engine, start=engine.epoch_index)
        return {"lines": lines, "params": [p.tolist() for p in model.parameters()], "stopped_at": stopped_at}

    if resume:
        report["resumed"] = attempt(resumed)
        if HAVE_DEEPSPEED:
            report["deepspeed"] = attempt(lambda: _deepspeed(rank, REG, 0))
            report["deepspeed-z2"] = attempt(lambda: _deepspeed(rank, REG, 2))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def _deepspeed(rank, case, stage):
    """The case under DeepSpeed (client optimizer, fp32, our engine's clipping) with noise_scale on."""
    import logging

    import deepspeed
    from deepspeed.utils import logger as ds_logger

    from accum_sched import AccumulationEngine

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed insists on it
    ds_logger.setLevel(logging.WARNING)
    model = cases.make_model(case)
    config = {"train_micro_batch_size_per_gpu": case.micro, "gradient_accumulation_steps": 2,
              "train_batch_size": case.micro * 2 * 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "gradient_clipping": 0.0}
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=cases.make_optimizer(case, model), config=config)
    engine = AccumulationEngine(ds_engine, None, case.schedule, max_grad_norm=case.clip, noise_scale=True)
    lines = []
    engine.on_step(lambda info: lines.append(info.to_dict()))
    _train(case, rank, 2, engine)
    return {"lines": lines, "params": [p.tolist() for p in model.parameters()]}


def _launch(world: int, tmp_path_factory, resume: bool):
    if resume and HAVE_DEEPSPEED:
        from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        ensure_torch_extensions_dir()
    out = str(tmp_path_factory.mktemp(f"gns{world}"))
    spawn(_ranks, world, out, resume, deadline_s=600)
    reports = []
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch(2, tmp_path_factory, resume=True)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return _launch(3, tmp_path_factory, resume=False)


# -- the plain-torch reference ----------------------------------------------------------------------------------
def _flat_grad(model, loss):
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double()
                      for g, p in zip(grads, model.parameters())])


def reference_inputs(case, world: int, per_rank_windows=None):
    """Per window: the four inputs, from per-rank sums of element losses, and the model trained on the global mean.

    ``per_rank_windows``: the micro-batch indices of each window treated as a small batch (one process: each
    micro-batch on its own); by default each rank's share of the window is one small batch."""
    model = cases.make_model(case)
    optimizer = cases.make_optimizer(case, model)
    schedule = cases.AccumulationSchedule(case.schedule)
    expected = []
    for epoch in range(case.epochs):
        batches = [cases.rank_batches(case, r, epoch) for r in range(world)]
        n = min(len(b) for b in batches)
        start = 0
        while start < n:
            size = min(schedule.factor(epoch), n - start)
            small = []  # (sum of gradients, elements) of each small batch
            for r in range(world):
                groups = [[i] for i in range(start, start + size)] if per_rank_windows else [range(start, start + size)]
                for group in groups:
                    total, count = 0.0, 0
                    for i in group:
                        losses, valid = cases.element_losses(model, batches[r][i], case.kind)
                        total = total + (losses * valid).sum()
                        count += int(valid.sum())
                    small.append((_flat_grad(model, total), count))
            big = sum(g for g, _ in small) / sum(c for _, c in small)
            expected.append({
                "gns_local_sq": sum(float((g / c).square().sum()) for g, c in small) / len(small),
                "gns_global_sq": float(big.square().sum()),
                "gns_b_local": sum(c for _, c in small) / len(small),
                "gns_b_global": sum(c for _, c in small)})
            offset = 0
            for p in model.parameters():
                p.grad = big[offset:offset + p.numel()].view_as(p).float().clone()
                offset += p.numel()
            if case.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
            optimizer.step()
            optimizer.zero_grad()
            start += size
    return expected, [p.detach() for p in model.parameters()]


def _check_inputs(lines, expected):
    assert len(lines) == len(expected)
    for step, (line, ref) in enumerate(zip(lines, expected), 1):
        for key in FIELDS:
            assert line[key] == pytest.approx(ref[key], rel=2e-5, abs=1e-9), (step, key, line[key], ref[key])
        # the estimates are McCandlish App. A.1 of exactly these inputs
        b_small, b_big, small, big = line["gns_b_local"], line["gns_b_global"], line["gns_local_sq"], \
            line["gns_global_sq"]
        assert line["gns_grad_sq"] == pytest.approx((b_big * big - b_small * small) / (b_big - b_small), rel=1e-9)
        assert line["gns_trace"] == pytest.approx((small - big) / (1 / b_small - 1 / b_big), rel=1e-9)
        if line["gns_grad_sq_ema"] > 0:
            assert line["noise_scale"] == pytest.approx(line["gns_trace_ema"] / line["gns_grad_sq_ema"], rel=1e-9)
        else:  # no noise scale while the smoothed |G|^2 is not positive
            assert line["noise_scale"] is None


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", [REG, TOK], ids=["regression-prescaled", "tokens-clipped"])
def test_measured_inputs_equal_plain_torch(world, case, request):
    reports = request.getfixturevalue({2: "two", 3: "three"}[world])  # the 3-rank launch only for world 3
    expected, ref_params = reference_inputs(case, world)
    key = "regression" if case is REG else "tokens"
    for report in reports:
        seen = report[key]
        assert seen["error"] is None, seen["error"]
        _check_inputs(seen["result"]["lines"], expected)
        for got, want in zip(seen["result"]["params"], ref_params):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-4)
    assert any(line["micro_batches"] < line["factor"] for line in reports[0][key]["result"]["lines"])


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_zero0_measures_the_same_inputs_and_other_stages_are_refused(two):
    expected, ref_params = reference_inputs(REG, 2)
    for report in two:
        seen = report["deepspeed"]
        assert seen["error"] is None, seen["error"]
        _check_inputs(seen["result"]["lines"], expected)
        for got, want in zip(seen["result"]["params"], ref_params):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-4)
        error = report["deepspeed-z2"]["error"]
        assert error is not None and error[0] == "ValueError" and "ZeRO stage 0" in error[1], error


def test_one_process_takes_the_micro_batches_as_small_batches():
    model = cases.make_model(REG)
    engine = _engine(REG, model, 1, noise_scale=True, micro_batch_size=REG.micro)
    lines = []
    engine.on_step(lambda info: lines.append(info.to_dict()))
    _train(REG, 0, 1, engine)
    expected, _ = reference_inputs(REG, 1, per_rank_windows=True)
    _check_inputs([x for x in lines if x["micro_batches"] > 1], [e for e, x in zip(expected, lines)
                                                                 if x["micro_batches"] > 1])
    single = [x for x in lines if x["micro_batches"] == 1]  # B_small = B_big: no estimate, the EMAs carry on
    assert single and all(x["gns_grad_sq"] is None and x["gns_trace"] is None for x in single)


def test_adascale_gain_scales_the_lr_of_each_step(two):
    for report in two:
        assert report["adascale"]["error"] is None, report["adascale"]["error"]
        gains = []
        for x in report["adascale"]["result"]["lines"]:
            b_noise, batch = x["noise_scale"], x["gns_b_global"]
            base = batch * 1 / x["micro_batches"]  # the first factor (1) at this window's elements per micro-batch
            gain = 1.0 if b_noise is None or b_noise <= 0 else (b_noise / base + 1) / (b_noise / batch + 1)
            assert x["lr"] == pytest.approx(ADAPT.lr * gain, rel=1e-12), x
            assert 1.0 - 1e-12 <= gain <= x["micro_batches"] + 1e-12  # between 1 and B / B0
            gains.append(gain)
        assert max(gains) > 1.05, gains


def _brute_best(noise_scale, per_factor, low, high):
    return min(range(low, high + 1), key=lambda f: (abs(math.log(f * per_factor / noise_scale)), f))


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_adaptive_decisions_agree_on_every_rank_and_follow_the_rule(world, request):
    reports = request.getfixturevalue({2: "two", 3: "three"}[world])  # the 3-rank launch only for world 3
    runs = []
    for report in reports:
        assert report["adaptive"]["error"] is None, report["adaptive"]["error"]
        runs.append(report["adaptive"]["result"]["lines"])
    keys = ("factor", "factor_reason", "noise_scale", "gns_local_sq", "gns_global_sq")
    for other in runs[1:]:
        assert [[x[k] for k in keys] for x in other] == [[x[k] for k in keys] for x in runs[0]]
    lines = runs[0]
    factors = [x["factor"] for x in lines]
    assert len(set(factors)) > 1, factors  # the factor did move
    every, hyst = ADAPTIVE["every_n_steps"], ADAPTIVE["hysteresis"]
    for i in range(1, len(lines)):
        prev, line = lines[i - 1], lines[i]
        assert line["micro_batches"] <= line["factor"]
        if line["factor"] != prev["factor"]:
            assert prev["step"] % every == 0, (prev["step"], line)  # only at a decision boundary
        # a decision: the log-nearest factor, unless within hysteresis
        if prev["step"] % every == 0 and prev["noise_scale"] is not None:
            window = lines[i - every:i]
            per_factor = sum(x["elements"] for x in window) / sum(x["micro_batches"] for x in window)
            best = _brute_best(prev["noise_scale"], per_factor, ADAPTIVE["min_factor"], ADAPTIVE["max_factor"])
            off = prev["noise_scale"] / (prev["factor"] * per_factor)
            if line["factor"] == prev["factor"]:
                assert best == prev["factor"] or 1 / (1 + hyst) <= off <= 1 + hyst, (prev, line, best)
            else:
                assert line["factor"] == best and not 1 / (1 + hyst) <= off <= 1 + hyst, (prev, line, best)
            assert line["factor_reason"].startswith(f"step {prev['step']}:"), line["factor_reason"]


def test_resume_mid_run_repeats_the_decisions_bit_for_bit(two):
    for report in two:
        straight, resumed = report["adaptive"], report["resumed"]
        assert resumed["error"] is None, resumed["error"]
        epoch, micro = resumed["result"]["stopped_at"]
        assert micro > 0, resumed["result"]["stopped_at"]  # stopped inside an epoch
        assert len({x["factor"] for x in straight["result"]["lines"][STOP_AFTER + 1:]}) > 1  # decisions after it
        assert resumed["result"]["lines"] == straight["result"]["lines"]  # floats compared exactly
        assert resumed["result"]["params"] == straight["result"]["params"]


def test_refused_where_the_local_gradient_is_not_at_hand():
    from accum_sched import AccumulationEngine
    from accum_sched.adaptive import AdaptiveFactor

    model = cases.make_model(REG)
    optimizer = cases.make_optimizer(REG, model)
    with pytest.raises(ValueError, match="normalize='elements'"):
        AccumulationEngine(model, optimizer, 2, noise_scale=True, normalize="micro_batches")
    with pytest.raises(ValueError, match="adascale"):
        AccumulationEngine(model, optimizer, 2, lr_coupling="adascale")
    with pytest.raises(ValueError, match="not both"):
        AccumulationEngine(model, optimizer, 2, adaptive={"min_factor": 2})
    with pytest.raises(ValueError, match="max_factor"):
        AdaptiveFactor(min_factor=4, max_factor=2)
    with pytest.raises(ValueError, match="min_factor >= 2"):
        AccumulationEngine(model, optimizer, adaptive={"min_factor": 1})


# -- the launcher: config checks, a run killed and resumed by torchrun, the report ---------------------------------
ADAPTIVE_RUN = """\
run: {{output_dir: {out}, seed: 0, epochs: 3}}
task: {{target: "faulty_tasks:regression", args: {{dropout: 0.1}}}}
data: {{micro_batch_size: 4, shuffle: true}}
accumulation: {{adaptive: {{min_factor: 1, max_factor: 8, every_n_steps: 4, ema: 0.8}}}}
optimizer: {{name: adamw, lr: 0.01}}
lr_scheduler: null
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 4, keep_last: 2}}
logging: {{progress: plain, tensorboard: "off"}}
"""


def test_config_refuses_what_cannot_be_measured_or_planned():
    import yaml

    from launcher.config import validate
    from launcher.errors import ConfigError

    base = yaml.safe_load(ADAPTIVE_RUN.format(out="x"))
    cases_ = [({"accumulation": {"schedule": 2}}, "accumulation.schedule"),
              ({"lr_scheduler": {"name": "cosine"}}, "lr_scheduler.name"),
              ({"accumulation": {"normalize": "micro_batches"}}, "accumulation.adaptive"),
              ({"accumulation": {"adaptive": {"min_factor": 4, "max_factor": 2}}}, "accumulation.adaptive.max_factor"),
              ({"accumulation": {"adaptive": {"ema": 1.0}}}, "accumulation.adaptive.ema"),
              ({"accumulation": {"adaptive": {"evry_n_steps": 3}}}, "accumulation.adaptive.evry_n_steps"),
              ({"accumulation": {"adaptive": None, "lr_coupling": "adascale"}}, "accumulation.lr_coupling"),
              ({"accumulation": {"adaptive": None, "noise_scale": True}, "run": {"precision": "fp16"}},
               "accumulation.noise_scale"),
              ({"accumulation": {"adaptive": None, "noise_scale": True}, "distributed": {
                  "backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}}},
               "accumulation.noise_scale"),
              ({"distributed": {"backend": "deepspeed", "deepspeed_config": {}}}, "accumulation.adaptive"),
              ({"distributed": {"nproc_per_node": 1}}, "accumulation.adaptive.min_factor")]
    for change, field in cases_:
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
        for section, values in change.items():
            raw[section] = {**(raw.get(section) or {}), **values}
        with pytest.raises(ConfigError) as info:
            validate(raw)
        assert info.value.field == field, (change, str(info.value))
    validate(base)


@pytest.mark.slow
def test_run_killed_and_resumed_repeats_the_adaptive_run_and_reports_it(tmp_path):
    import subprocess
    import sys

    tests = paths.TESTS
    root = os.path.dirname(tests)

    def accum(*args, fault=None):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
        env.update(PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""), **(fault or {}))
        proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=tests, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout + proc.stderr

    def metrics(name):
        with open(tmp_path / name / "metrics.jsonl") as f:
            timing = ("wall_time", "samples_per_s", "tokens_per_s", "elapsed_s")  # differ between runs
            return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in f]

    for name in ("ref", "killed"):
        (tmp_path / f"{name}.yaml").write_text(ADAPTIVE_RUN.format(out=tmp_path / name))
    accum("run", str(tmp_path / "ref.yaml"))
    marker = tmp_path / "marker"
    fault = {"FAULT_MODE": "kill", "FAULT_RANK": "1", "FAULT_AT": "80", "FAULT_MARKER": str(marker)}  # in epoch 2
    text = accum("run", str(tmp_path / "killed.yaml"), "--max-restarts", "1", fault=fault)
    assert marker.exists() and "resumed from " in text
    ref, killed = metrics("ref"), metrics("killed")
    assert len({x["factor"] for x in ref}) > 2 and all("factor_reason" in x for x in ref)
    assert all(isinstance(x[k], float) for x in ref for k in FIELDS)
    assert json.dumps(killed) == json.dumps(ref)  # every decision, estimate and loss, bit for bit
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("ref", "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    report = accum("report", str(tmp_path / "killed"))
    assert "noise scale       " in report and (tmp_path / "killed" / "noise_scale.png").stat().st_size > 10_000
