"""Ranks stay in lockstep: disagreements raise on every rank in bounded time, uneven loaders never hang, and DDP
launches exactly one gradient all-reduce round per optimizer step.

All checks run in one launch of 2 real gloo processes (start-up dominates); each rank records what it saw and the
test process judges it, so a failure names the scenario. The launch has a deadline: a hang fails instead of
waiting for gloo's 30-minute timeout.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import cases
from accum_sched import AccumulationSchedule
from distributed import attempt, spawn

DEADLINE_S = 150  # the whole launch, start-up included; a disagreement itself must surface within 60 s

UNEVEN = cases.Case("uneven", {0: 4, 1: 2}, epochs=2, samples=(28, 24))  # rank 0: 7 micro-batches, rank 1: 6
COUNTED = cases.Case("counted", {0: 1, 1: 4}, epochs=2, samples=(64, 64))  # 16 micro-batches per rank
MISMATCH = {"factor": ({0: 2}, {0: 3}), "fingerprint": ({0: 2, 3: 4}, {0: 2, 3: 8})}


def _engine(case, rank, world, schedule=None, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    model = cases.make_model(case)
    optimizer = cases.make_optimizer(case, model)
    engine = AccumulationEngine(DDP(model), optimizer, case.schedule if schedule is None else schedule, **kwargs)
    return model, engine


def _lockstep_checks(rank: int, world: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched.backends.counting import CountingState as _Counter
    from accum_sched.backends.counting import counting_allreduce as _counting_allreduce

    report = {}
    loss_fn = cases.loss_fn_for("regression")

    # 1. one rank runs another schedule: a different factor at epoch 0, or the same factor but a later difference
    for name, specs in MISMATCH.items():
        def run(specs=specs):
            _, engine = _engine(COUNTED, rank, world, schedule=specs[rank])
            engine.train_epoch(cases.rank_batches(COUNTED, rank, 0), loss_fn, 0)
        report[name] = attempt(run)

    # 2. uneven loaders (7 vs 6 micro-batches): truncate trains 6 on every rank, error raises on every rank
    def truncated():
        model, engine = _engine(UNEVEN, rank, world, uneven="truncate")
        for epoch in range(UNEVEN.epochs):
            engine.train_epoch(cases.rank_batches(UNEVEN, rank, epoch), loss_fn, epoch)
        torch.save(cases.params(model), os.path.join(out_dir, f"truncate-{rank}.pt"))
        return engine.counters()

    report["truncate"] = attempt(truncated)

    def strict():
        _, engine = _engine(UNEVEN, rank, world, uneven="error")
        engine.train_epoch(cases.rank_batches(UNEVEN, rank, 0), loss_fn, 0)

    report["error"] = attempt(strict)

    # 3. one rank asks to stop: every rank stops after the same optimizer step
    def stop_one():
        _, engine = _engine(COUNTED, rank, world)
        engine.on_step(lambda info: engine.request_stop() if rank == 1 and info.step == 2 else None)
        for epoch in range(COUNTED.epochs):
            engine.train_epoch(cases.rank_batches(COUNTED, rank, epoch), loss_fn, epoch)
            if engine.should_stop:
                break
        return {"steps": engine.optimizer_steps, "stopped": engine.should_stop}

    report["stop"] = attempt(stop_one)

    # 4. gradient all-reduce rounds, counted by the same DDP comm hook the engine registers
    def engine_rounds():
        model, engine = _engine(COUNTED, rank, world)
        for epoch in range(COUNTED.epochs):
            engine.train_epoch(cases.rank_batches(COUNTED, rank, epoch), loss_fn, epoch)
        return {"steps": engine.optimizer_steps, "rounds": engine.allreduce_rounds,
                "bytes": engine.backend.allreduce_bytes,
                "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}

    report["rounds-engine"] = attempt(engine_rounds)

    def plain_rounds(use_no_sync: bool):
        factor = 4
        model = cases.make_model(COUNTED)
        ddp = DDP(model)
        counter = _Counter()
        ddp.register_comm_hook(counter, _counting_allreduce)
        optimizer = cases.make_optimizer(COUNTED, model)
        batches = cases.rank_batches(COUNTED, rank, 0)
        steps = 0
        for start in range(0, len(batches), factor):
            window = batches[start:start + factor]
            for i, (x, y) in enumerate(window):
                local = use_no_sync and i < len(window) - 1
                with ddp.no_sync() if local else torch.enable_grad():
                    (((ddp(x) - y) ** 2).sum(-1).mean() / len(window)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
        return {"steps": steps, "rounds": counter.rounds, "factor": factor}

    report["rounds-every-micro-batch"] = attempt(lambda: plain_rounds(False))
    report["rounds-no_sync"] = attempt(lambda: plain_rounds(True))

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("lockstep")
    spawn(_lockstep_checks, 2, str(out), deadline_s=DEADLINE_S)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", sorted(MISMATCH))
def test_different_schedule_raises_on_every_rank(reports, name):
    _, per_rank = reports
    specs = [AccumulationSchedule(s) for s in MISMATCH[name]]
    for rank, report in enumerate(per_rank):
        seen = report[name]
        assert seen["error"] is not None, f"rank {rank} trained on with a schedule that differs from its peer's"
        kind, message = seen["error"]
        assert kind == "RankDisagreement", message
        assert seen["seconds"] < 60, seen
        if name == "factor":
            assert "accumulation factor" in message and "2..3" in message, message
        lo, hi = sorted(s.fingerprint() for s in specs)
        assert "schedule fingerprint" in message and f"{lo}..{hi}" in message, message
        assert f"this rank {specs[rank].fingerprint()}" in message, message


def test_uneven_loader_truncates_to_the_shortest_rank(reports):
    out, per_rank = reports
    ref = cases.params(cases.reference(UNEVEN, 2))  # the reference uses each epoch's shortest rank
    for rank, report in enumerate(per_rank):
        seen = report["truncate"]
        assert seen["error"] is None, seen["error"]
        counters = seen["result"]
        assert counters["micro_batches"] == 6 * UNEVEN.epochs, counters
        assert counters["optimizer_steps"] == AccumulationSchedule(UNEVEN.schedule).optimizer_steps(6, 2), counters
        got = torch.load(out / f"truncate-{rank}.pt")
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    uneven_warnings = [w for w in per_rank[0]["truncate"]["warnings"] if "between 6 and 7" in w]
    assert len(uneven_warnings) == UNEVEN.epochs and "first 6" in uneven_warnings[0], per_rank[0]["truncate"]


def test_uneven_loader_with_uneven_error_raises_on_every_rank(reports):
    _, per_rank = reports
    for report in per_rank:
        seen = report["error"]
        assert seen["error"] is not None and seen["error"][0] == "RankDisagreement", seen
        assert "between 6 and 7" in seen["error"][1] and "uneven='truncate'" in seen["error"][1], seen
        assert seen["seconds"] < 60, seen


def test_stop_requested_on_one_rank_stops_every_rank_at_the_same_step(reports):
    _, per_rank = reports
    results = [report["stop"]["result"] for report in per_rank]
    assert results[0] == results[1] == {"steps": 3, "stopped": True}, results  # agreed at the end of step 3


def test_one_gradient_allreduce_round_per_optimizer_step(reports):
    _, per_rank = reports
    for report in per_rank:
        engine = report["rounds-engine"]["result"]
        assert engine["steps"] == AccumulationSchedule(COUNTED.schedule).optimizer_steps(16, 2) == 16 + 4
        assert engine["rounds"] == engine["steps"], engine
        assert engine["bytes"] == engine["param_bytes"] * engine["steps"], engine  # every gradient once per step
        no_sync = report["rounds-no_sync"]["result"]
        assert no_sync["rounds"] == no_sync["steps"] == 4, no_sync
        every = report["rounds-every-micro-batch"]["result"]
        assert every["rounds"] == every["factor"] * every["steps"] == 16, every  # what no_sync saves
