"""Ranks stay in lockstep: disagreements raise on every rank in bounded time, uneven loaders never hang, and DDP
launches exactly one gradient all-reduce round per optimizer step.

All checks run in one launch of 2 real gloo processes (start-up dominates); each rank records what it saw and the
test process judges it, so a failure names the scenario. The launch has a deadline: a hang fails instead of
waiting for gloo's 30-minute timeout.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import cases
from accum_sched import AccumulationSchedule

DEADLINE_S = 150  # the whole launch, start-up included; a disagreement itself must surface within 60 s

UNEVEN = cases.Case("uneven", {0: 4, 1: 2}, epochs=2, samples=(28, 24))  # rank 0: 7 micro-batches, rank 1: 6
COUNTED = cases.Case("counted", {0: 1, 1: 4}, epochs=2, samples=(64, 64))  # 16 micro-batches per rank
MISMATCH = {"factor": ({0: 2}, {0: 3}), "fingerprint": ({0: 2, 3: 4}, {0: 2, 3: 8})}


def _entry_without_teardown(rank: int, world: int, init_file: str, fn, args) -> None:
    """distributed._entry minus the process-group teardown, which on this machine occasionally aborts a process
    ("terminate called without an active exception") after everything it had to do is done: seen in the
    benchmark's plain DDP loops too, so not ours. The ranks meet at a barrier, so none leaves while a peer still
    talks to it, then exit at once."""
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    fn(rank, world, *args)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_bounded(fn, world: int, deadline_s: float, *args) -> None:
    """Like distributed.spawn, but kill the ranks (ours) and fail if they are still running after ``deadline_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_entry_without_teardown, args=(world, os.path.join(tmp, "store"), fn, args),
                                     nprocs=world, join=False, start_method="spawn")
        start = time.monotonic()
        while not context.join(timeout=1.0):
            if time.monotonic() - start > deadline_s:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"ranks still running after {deadline_s} s: a collective hangs")


def _engine(case, rank, world, schedule=None, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    model = cases.make_model(case)
    optimizer = cases.make_optimizer(case, model)
    engine = AccumulationEngine(DDP(model), optimizer, case.schedule if schedule is None else schedule, **kwargs)
    return model, engine


def _attempt(fn) -> dict:
    """Run ``fn``; return what happened: exception type and message, seconds taken, warnings raised."""
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
            error = None
        except Exception as exc:  # judged by the test process
            result, error = None, (type(exc).__name__, str(exc))
    return {"error": error, "seconds": time.monotonic() - start, "warnings": [str(w.message) for w in caught],
            "result": result}


def _lockstep_checks(rank: int, world: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched.backends import _counting_allreduce, _Counter

    report = {}
    loss_fn = cases.loss_fn_for("regression")

    # 1. one rank runs another schedule: a different factor at epoch 0, or the same factor but a later difference
    for name, specs in MISMATCH.items():
        def run(specs=specs):
            _, engine = _engine(COUNTED, rank, world, schedule=specs[rank])
            engine.train_epoch(cases.rank_batches(COUNTED, rank, 0), loss_fn, 0)
        report[name] = _attempt(run)

    # 2. uneven loaders (7 vs 6 micro-batches): truncate trains 6 on every rank, error raises on every rank
    def truncated():
        model, engine = _engine(UNEVEN, rank, world, uneven="truncate")
        for epoch in range(UNEVEN.epochs):
            engine.train_epoch(cases.rank_batches(UNEVEN, rank, epoch), loss_fn, epoch)
        torch.save(cases.params(model), os.path.join(out_dir, f"truncate-{rank}.pt"))
        return engine.counters()

    report["truncate"] = _attempt(truncated)

    def strict():
        _, engine = _engine(UNEVEN, rank, world, uneven="error")
        engine.train_epoch(cases.rank_batches(UNEVEN, rank, 0), loss_fn, 0)

    report["error"] = _attempt(strict)

    # 3. one rank asks to stop: every rank stops after the same optimizer step
    def stop_one():
        _, engine = _engine(COUNTED, rank, world)
        engine.on_step(lambda info: engine.request_stop() if rank == 1 and info.step == 2 else None)
        for epoch in range(COUNTED.epochs):
            engine.train_epoch(cases.rank_batches(COUNTED, rank, epoch), loss_fn, epoch)
            if engine.should_stop:
                break
        return {"steps": engine.optimizer_steps, "stopped": engine.should_stop}

    report["stop"] = _attempt(stop_one)

    # 4. gradient all-reduce rounds, counted by the same DDP comm hook the engine registers
    def engine_rounds():
        model, engine = _engine(COUNTED, rank, world)
        for epoch in range(COUNTED.epochs):
            engine.train_epoch(cases.rank_batches(COUNTED, rank, epoch), loss_fn, epoch)
        return {"steps": engine.optimizer_steps, "rounds": engine.allreduce_rounds,
                "bytes": engine.backend.allreduce_bytes,
                "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}

    report["rounds-engine"] = _attempt(engine_rounds)

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

    report["rounds-every-micro-batch"] = _attempt(lambda: plain_rounds(False))
    report["rounds-no_sync"] = _attempt(lambda: plain_rounds(True))

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("lockstep")
    spawn_bounded(_lockstep_checks, 2, DEADLINE_S, str(out))
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
