"""Schedules keyed by optimizer steps, samples and tokens; ramps; fixed global batch; LR coupling.

The reference keeps its own counters (steps done, samples and tokens consumed on all ranks) and looks the factor up
by brute force, window by window, then steps one large batch per window.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import cases
import paths
from accum_sched import AccumulationSchedule
from accum_sched.planning import simulate_steps
from distributed import spawn

UNIT_CASES = cases.UNIT_CASES


def _train(rank, world, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case, unit, coupling in UNIT_CASES:
            model = cases.make_model(case)
            engine = AccumulationEngine(DDP(model), cases.make_optimizer(case, model),
                                        AccumulationSchedule(case.schedule, unit), max_grad_norm=case.clip,
                                        lr_coupling=coupling)
            for epoch in range(case.epochs):
                engine.train_epoch(cases.rank_batches(case, rank, epoch), cases.loss_fn_for(case.kind), epoch)
            factors = sorted({engine.schedule.factor_at(0), engine.factor})
            torch.save({"params": cases.params(model), "factors": factors, "steps": engine.optimizer_steps},
                       os.path.join(out_dir, f"{case.name}-{rank}.pt"))


def test_unit_keyed_schedules_match_reference(tmp_path):
    spawn(_train, 2, str(tmp_path))
    for case, unit, coupling in UNIT_CASES:
        ref = cases.params(cases.reference_units(case, unit, coupling, 2))
        per_rank = [torch.load(tmp_path / f"{case.name}-{rank}.pt") for rank in range(2)]
        for rank, got in enumerate(per_rank):
            what = f"{case.name} (rank {rank})"
            assert got["factors"][0] != got["factors"][-1], what  # the factor really changed mid-run
            assert (got["factors"], got["steps"]) == (per_rank[0]["factors"], per_rank[0]["steps"]), what
            for g, r, first in zip(got["params"], ref, per_rank[0]["params"], strict=True):
                torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5, msg=lambda m, what=what: f"{what}: {m}")
                assert torch.equal(g, first), f"{what}: differs from rank 0"


def brute_steps(schedule, batches, epochs, per_micro):
    steps = consumed = 0
    counters = {"step": 0, "samples": 0, "tokens": 0}
    for epoch in range(epochs):
        i = 0
        while i < batches:
            f = cases.brute_factor(schedule, {"epoch": epoch, **counters}[schedule.unit])
            take = min(f, batches - i)
            for j in range(i, i + take):
                consumed = per_micro(epoch, j)
                counters["samples"] += consumed
                counters["tokens"] += consumed
            i += take
            steps += 1
            counters["step"] = steps
    return steps


@pytest.mark.parametrize("unit", ["step", "samples", "tokens"])
def test_totals_against_brute_force(unit):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(keys=st.lists(st.integers(1, 400), min_size=0, max_size=4, unique=True),
           factors=st.lists(st.integers(1, 7), min_size=5, max_size=5),
           batches=st.integers(1, 30), epochs=st.integers(1, 4), per=st.integers(1, 40))
    def check(keys, factors, batches, epochs, per):
        spec = dict(zip([0] + sorted(keys), factors))
        schedule = AccumulationSchedule(spec, unit)
        per_micro = (lambda e, i: per + (i * 7 + e) % 5)
        kwargs = {"samples": {"samples_per_micro_step": per_micro},
                  "tokens": {"tokens_per_micro_step": per_micro}}.get(unit, {})
        assert schedule.optimizer_steps(batches, epochs, **kwargs) == brute_steps(schedule, batches, epochs,
                                                                                  per_micro)
        assert simulate_steps(schedule, batches, epochs, **kwargs) == schedule.optimizer_steps(batches, epochs,
                                                                                               **kwargs)

    check()


def test_ramp_and_suffixes():
    ramp = AccumulationSchedule({"ramp": {"start": 1, "end": 4, "over": 10}}, "step")
    assert [ramp.factor_at(v) for v in range(12)] == [min(4, 1 + 3 * v // 10) for v in range(12)]
    down = AccumulationSchedule({"ramp": {"start": 8, "end": 2, "over": "6K"}}, "samples")
    assert down.factor_at(0) == 8 and down.factor_at(999) == 8 and down.factor_at(1000) == 7
    assert down.factor_at(6000) == 2 and down.factor_at(10**9) == 2
    tokens = AccumulationSchedule("0:768,250B:1536", "tokens")
    assert tokens.milestones == ((0, 768), (250 * 10**9, 1536))
    assert AccumulationSchedule({"1.5M": 2}, "samples").milestones == ((1_500_000, 2),)


ROOT = paths.ROOT
BASE = """\
run: {output_dir: out, epochs: 3}
task: {target: builtin:regression}
data: {micro_batch_size: 8}
accumulation: {unit: samples, schedule: {0: 1, 100: 2}}
distributed: {nproc_per_node: 2}
"""


def check_cli(tmp_path, *args):
    (tmp_path / "cfg.yaml").write_text(BASE)
    return subprocess.run([sys.executable, "-m", "launcher", "check", "cfg.yaml", *args], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.parametrize("schedule,problem", [
    ("{0: 1, 500: 2, 100: 4}", "must increase"),
    ("{0: 1, -5: 2}", "negative"),
    ("{0: 1, 5X: 2}", "K/M/B/T"),
    ("{ramp: {start: 1, end: 4}}", "start, end and over"),
])
def test_bad_thresholds_exit_2(tmp_path, schedule, problem):
    proc = check_cli(tmp_path, "--set", f"accumulation.schedule={schedule}")
    assert proc.returncode == 2 and proc.stderr.startswith("error: accumulation.schedule: "), proc.stderr
    assert problem in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_check_prints_simulated_totals(tmp_path):
    proc = check_cli(tmp_path, "--batches-per-epoch", "10")
    assert proc.returncode == 0, proc.stderr
    # 16 samples per micro-step: factor 1 until 100 samples (7 steps = 112 samples), then factor 2
    schedule = AccumulationSchedule({0: 1, 100: 2}, "samples")
    expected = brute_steps(schedule, 10, 3, lambda e, i: 16)
    assert f"total optimizer steps over 3 epochs: {expected}" in proc.stdout
    assert expected == 7 + 2 + 5 + 5


def test_global_batch(tmp_path):
    proc = check_cli(tmp_path, "--set", "accumulation.schedule=null", "--set", "accumulation.global_batch=64")
    assert proc.returncode == 0, proc.stderr
    assert ["0+", "4", "8", "2", "64"] in [line.split() for line in proc.stdout.splitlines()], proc.stdout
    bad = check_cli(tmp_path, "--set", "accumulation.schedule=null", "--set", "accumulation.global_batch=60")
    assert bad.returncode == 2 and "accumulation.global_batch: 60 is not a multiple of" in bad.stderr
