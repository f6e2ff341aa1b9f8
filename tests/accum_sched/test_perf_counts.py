"""The per-step path costs what a hand-written loop costs, counted without trusting the engine's own counters.

The engine is built as the launcher's worker builds it (``stop_at="micro_batch"``); the counters are the tests' own
(tests/counters.py).

* host syncs: every read of a tensor's value into Python made on behalf of ``accum_sched`` (``item``, ``tolist``,
  ``numpy``, ``cpu``, ``float()``..., also through torch: the GradScaler's, torch.distributed's) is counted: none per
  micro-batch, at most one per optimizer step, besides the stop flag's read (host memory by design);
* collectives: every collective launched in the rank processes is seen with its size and group, whichever layer
  launched it (Python, DDP's C++ reducer). Per optimizer step there must be exactly the DDP buckets (several: a
  small ``bucket_cap_mb``), whose sizes add up to the model plus the window's numbers carried in one of them, and
  no small collective on the training group; per epoch, the one agreement; per micro-batch, the stop flag's
  one-number sum on its side group;
* every rank's parameters equal the plain-torch large-batch reference (so the multi-bucket norm used for clipping
  and the counts carried in a bucket are right, not merely present).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import cases
from accum_sched import window_stats
from counters import CollectiveCounter, SyncCounter
from distributed import attempt, spawn

# partial last windows (factor 3 and 5 do not divide 10 micro-batches), clipping: the norm over several buckets
LAYERS = cases.Case("layers-clip", {0: 1, 1: 3, 2: 5}, epochs=3, samples=(40, 38), kind="layers", clip=0.05,
                    lr=0.02)
BUCKET_CAP_MB = 0.01  # ~2600 fp32 numbers: the 64x64 layers land in separate buckets (3 after DDP's first round)


# The stop flag the launcher's engine (stop_at="micro_batch") sums once per micro-batch: a one-number float64 tensor
# in host memory, all-reduced on a gloo side group, so reading it is no device sync on a GPU either. Its reads and
# its collectives are told apart by where they come from and which group they run on, and bounded on their own.
STOP_FLAG_READ = "accum_sched.stop_poll.StopPoll.drain"


def _run_counted(case, rank, world, engine_kwargs, ddp_kwargs, precision="fp32", carrier=False):
    """Train ``case`` with the engine built as the launcher's worker builds it (stop_at="micro_batch") under both
    counters; per step: the syncs and collectives since the previous step. ``carrier``: the model built with
    ``accum_sched.wrap_ddp`` (the window's numbers in a parameter of their own, no comm hook)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine, wrap_ddp

    model = cases.make_model(case)
    wrapped = (wrap_ddp if carrier else DDP)(model, **ddp_kwargs) if world > 1 else model
    engine = AccumulationEngine(wrapped, cases.make_optimizer(case, model), case.schedule, max_grad_norm=case.clip,
                                stop_at="micro_batch", precision=precision, **engine_kwargs)
    loss_fn = cases.loss_fn_for(case.kind)
    steps = []
    with SyncCounter() as syncs, CollectiveCounter() as colls:
        marks = {"syncs": 0, "colls": 0}

        def on_step(info):
            steps.append({"epoch": info.epoch, "micro_batches": info.micro_batches,
                          "syncs": syncs.details[marks["syncs"]:],
                          "colls": [list(c) + [g] for c, g in zip(colls.calls[marks["colls"]:],
                                                                  colls.groups[marks["colls"]:])],
                          "grad_norm": info.grad_norm})
            marks.update(syncs=len(syncs.calls), colls=len(colls.calls))

        engine.on_step(on_step)
        for epoch in range(case.epochs):
            engine.train_epoch(cases.rank_batches(case, rank, epoch), loss_fn, epoch)
    params = sum(p.numel() for p in model.parameters())
    return model, {"steps": steps, "syncs": syncs.details, "params": params,
                   "colls": [list(c) + [g] for c, g in zip(colls.calls, colls.groups)],
                   "micro_batches": engine.micro_steps, "optimizer_steps": engine.optimizer_steps,
                   "comm_hooks": len(getattr(wrapped, "_comm_hooks", ())),  # DDP's list of registered comm hooks
                   "rounds": engine.counters().get("allreduce_rounds")}


def device_syncs(syncs: list[dict]) -> list[dict]:
    """The reads that would wait for a GPU: all but the stop flag's (host memory by design, see STOP_FLAG_READ)."""
    flag = [s for s in syncs if s["where"] == STOP_FLAG_READ]
    assert all(s["device"] == "cpu" and s["numel"] == 1 and s["dtype"] == "torch.float64" for s in flag), flag
    return [s for s in syncs if s["where"] != STOP_FLAG_READ]


def _rank_checks(rank: int, world: int, out_dir: str) -> None:
    report = {}

    def clipped():
        model, counts = _run_counted(LAYERS, rank, world, {}, {"bucket_cap_mb": BUCKET_CAP_MB})
        torch.save(cases.params(model), os.path.join(out_dir, f"clip-{rank}.pt"))
        return counts

    report["clip"] = attempt(clipped)

    def one_bucket():  # the same run with DDP's default buckets: one for this model
        model, counts = _run_counted(LAYERS, rank, world, {}, {})
        torch.save(cases.params(model), os.path.join(out_dir, f"one-{rank}.pt"))
        return counts

    report["one"] = attempt(one_bucket)

    def sparse_norm():  # no clipping, the norm every 2nd step only; micro-batch prescale on (full windows)
        case = cases.Case("layers-norm2", LAYERS.schedule, epochs=2, samples=(40, 38), kind="layers", lr=0.02)
        # gradients that are views of DDP's buckets: they must follow a bucket whose storage the hook grew
        model, counts = _run_counted(case, rank, world, {"norm_every": 2, "micro_batch_size": case.micro},
                                     {"bucket_cap_mb": BUCKET_CAP_MB, "gradient_as_bucket_view": True})
        torch.save(cases.params(model), os.path.join(out_dir, f"norm2-{rank}.pt"))
        return counts

    report["norm2"] = attempt(sparse_norm)

    def carried():  # accum_sched.wrap_ddp: no comm hook, the numbers in DDP's own (C++) reduction
        model, counts = _run_counted(LAYERS, rank, world, {}, {"bucket_cap_mb": BUCKET_CAP_MB}, carrier=True)
        torch.save(cases.params(model), os.path.join(out_dir, f"carrier-{rank}.pt"))
        return counts

    report["carrier"] = attempt(carried)
    with open(os.path.join(out_dir, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("perf")
    spawn(_rank_checks, 2, str(out), deadline_s=300)
    return out, [json.load(open(out / f"report-{r}.json")) for r in range(2)]


def _ok(report, name):
    assert report[name]["error"] is None, report[name]["error"]
    return report[name]["result"]


def _single(precision):
    case = cases.Case("single", {0: 1, 1: 3, 2: 4}, epochs=3, samples=(38,), kind="layers", clip=0.05)
    model, counts = _run_counted(case, 0, 1, {}, {}, precision=precision)
    assert counts["micro_batches"] > counts["optimizer_steps"] > 0
    for step in counts["steps"]:
        assert len(device_syncs(step["syncs"])) <= 1, step["syncs"]
    assert len(device_syncs(counts["syncs"])) <= counts["optimizer_steps"], counts["syncs"]
    assert counts["colls"] == []  # one process: nothing to sum
    return case, model


def test_single_process_one_host_sync_per_step_none_per_micro_batch():
    case, model = _single("fp32")
    ref = cases.reference(case, 1)
    for got, want in zip(cases.params(model), cases.params(ref)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_single_process_fp16_one_host_sync_per_step():
    """The GradScaler's verdict (found-inf, scale) rides in the window's one read: no get_scale(), no found-inf
    .item() of GradScaler.step."""
    _single("fp16")


def test_carrier_grows_a_bucket_that_owns_its_storage_and_copies_one_that_does_not():
    from accum_sched.backends.ddp_hook import HookState

    state = HookState(None)
    bucket = torch.arange(6.0)
    view = bucket[2:4]  # a gradient that is a view of the bucket, as DDP's are
    for step in range(2):  # the storage grows once; the second round reuses its tail
        stats = torch.full((3,), 10.0 + step)
        flat, tail = state.carrier(bucket, stats)
        assert flat.untyped_storage()._cdata == bucket.untyped_storage()._cdata  # no copy of the bucket
        assert flat[:6].data_ptr() == bucket.data_ptr() and torch.equal(tail, stats)
        flat.mul_(2)  # what the all-reduce does, in place
        assert torch.equal(bucket, torch.arange(6.0) * 2 ** (step + 1))
        assert torch.equal(view, torch.tensor([2.0, 3.0]) * 2 ** (step + 1))
        assert torch.equal(tail, stats * 2)
    assert state._flat is None

    owner = torch.arange(8.0)
    shared = owner[:6]  # memory after the bucket belongs to someone else: copied, never written past
    flat, tail = state.carrier(shared, torch.full((3,), 7.0))
    assert flat.data_ptr() != shared.data_ptr() and torch.equal(flat[:6], shared)
    assert torch.equal(tail, torch.full((3,), 7.0))
    flat.mul_(2)
    assert torch.equal(owner, torch.arange(8.0))


def _check_steps(counts, rank):
    """Per optimizer step: the DDP buckets and nothing else, one host sync; per epoch start: one agreement more.
    The stop flag: one read and one one-number all-reduce on another group per micro-batch, nothing more."""
    steps = counts["steps"]
    assert len(steps) == counts["optimizer_steps"] > 0
    for i, step in enumerate(steps):
        world = [(name, n) for name, n, group in step["colls"] if group == "world"]
        side = [(name, n) for name, n, group in step["colls"] if group != "world"]
        small = [c for c in world if c[1] <= 64]
        big = [c for c in world if c[1] > 64]
        epoch_start = i == 0 or steps[i - 1]["epoch"] != step["epoch"]  # the agreement ran in this interval
        # DDP's own one-time bucket rebuild after its first round: two broadcasts (the bucket order), no more
        rebuild = [c for c in small if c[0] == "broadcast"] if i == 1 else []
        assert len(rebuild) in (0, 2) and len(small) - len(rebuild) == int(epoch_start), (rank, i, step["colls"])
        assert all(name == "all_reduce" for name, _ in big), step["colls"]
        assert len(device_syncs(step["syncs"])) == 1 + int(epoch_start), (rank, i, step["syncs"])
        assert side == [("all_reduce", 1)] * len(side) and len(side) <= step["micro_batches"] + 1, (rank, i, side)
        # the model + the window's numbers
        assert sum(n for _, n in big) == counts["params"] + window_stats.SIZE, (rank, i, big)
        if i > 0:  # DDP's first round reduces one bucket holding everything, then it rebuilds its buckets
            assert len(big) >= 3, (rank, i, big)  # several buckets: the multi-bucket norm and carrier paths run
    flag_reads = [s for s in counts["syncs"] if s["where"] == STOP_FLAG_READ]
    flag_sums = [c for c in counts["colls"] if c[2] != "world"]
    # a window of f micro-batches starts f - 2 polls: none at its last micro-batch (the flag rides in the window's
    # numbers) nor at the one before (its answer would come after the boundary's)
    polls = sum(max(step["micro_batches"] - 2, 0) for step in steps)
    assert len(flag_reads) == len(flag_sums) == polls > 0, (len(flag_reads), len(flag_sums), polls)


@pytest.mark.slow
def test_ddp_step_has_only_its_buckets_and_one_host_sync(ranks):
    _, reports = ranks
    for rank, report in enumerate(reports):
        counts = _ok(report, "clip")
        _check_steps(counts, rank)
        assert all(step["grad_norm"] is not None for step in counts["steps"])  # clipping measures it every step


@pytest.mark.slow
def test_wrap_ddp_step_has_only_its_buckets_and_no_comm_hook(ranks):
    """accum_sched.wrap_ddp: the same collectives per step as with the engine's hook (the model's buckets, the
    window's numbers inside them, nothing else), and no comm hook registered on the DDP module."""
    _, reports = ranks
    for rank, report in enumerate(reports):
        counts = _ok(report, "carrier")
        _check_steps(counts, rank)
        assert counts["comm_hooks"] == 0 and _ok(report, "clip")["comm_hooks"] == 1  # the engine's hook, elsewhere
        assert all(step["grad_norm"] is not None for step in counts["steps"])
        assert counts["rounds"] == counts["optimizer_steps"]  # what it reports, against the count of the buckets


@pytest.mark.slow
def test_ddp_every_rank_equals_the_large_batch_reference(ranks):
    out, reports = ranks
    for name, case in (("clip", LAYERS), ("carrier", LAYERS),
                       ("norm2", cases.Case("layers-norm2", LAYERS.schedule, epochs=2, samples=(40, 38),
                                            kind="layers", lr=0.02))):
        ref = cases.params(cases.reference(case, 2))
        for rank in range(2):
            _ok(reports[rank], name)
            got = torch.load(out / f"{name}-{rank}.pt")
            for g, w in zip(got, ref):
                assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (name, rank, (g - w).abs().max())


@pytest.mark.slow
def test_grad_norm_and_clipping_do_not_depend_on_the_bucket_layout(ranks):
    """The norm is the same float whatever DDP's buckets (several or one, and laid out again after the first round):
    a norm summed per bucket rounds differently, and a resumed run, whose first round has the initial layout, would
    then clip by another factor than the run that went straight on."""
    out, reports = ranks
    for rank, report in enumerate(reports):
        several, one = _ok(report, "clip"), _ok(report, "one")
        assert [s["grad_norm"] for s in several["steps"]] == [s["grad_norm"] for s in one["steps"]], rank
        for a, b in zip(torch.load(out / f"clip-{rank}.pt"), torch.load(out / f"one-{rank}.pt")):
            assert torch.equal(a, b), rank


@pytest.mark.slow
def test_grad_norm_measured_at_its_cadence_only(ranks):
    _, reports = ranks
    for rank, report in enumerate(reports):
        counts = _ok(report, "norm2")
        _check_steps(counts, rank)
        norms = [s["grad_norm"] for s in counts["steps"]]
        assert [n is not None for n in norms] == [(i + 1) % 2 == 0 for i in range(len(norms))], norms
        assert all(n > 0 for n in norms if n is not None)


def test_nonfinite_gradient_with_finite_loss_is_caught_where_the_norm_is_measured():
    """A NaN gradient under a finite loss is seen through the norm: at every step with norm_every=1, not with None
    (the documented price of skipping the pass); a NaN loss is caught either way."""
    from accum_sched import AccumulationEngine

    case = cases.Case("nan-grad", {0: 2}, epochs=1, samples=(32,), kind="layers")
    skipped = {}
    for norm_every in (1, None):
        model = cases.make_model(case)
        engine = AccumulationEngine(model, cases.make_optimizer(case, model), case.schedule, norm_every=norm_every)
        calls = {"n": 0}

        def poison(grad):
            calls["n"] += 1
            return grad * float("nan") if calls["n"] == 3 else grad  # the 3rd backward: window 2's first half

        model[0].weight.register_hook(poison)
        steps = []
        engine.on_step(steps.append)
        engine.train_epoch(cases.rank_batches(case, 0, 0), cases.loss_fn_for(case.kind), 0)
        skipped[norm_every] = [s.step for s in steps if s.skipped]
        assert all(s.grad_norm is None for s in steps) if norm_every is None else all(
            s.grad_norm is not None for s in steps)
    assert skipped[1] == [2]
    # unmeasured, the NaN gradient reaches the weights at step 2; the next losses are NaN, and those steps are skipped
    assert 2 not in skipped[None] and skipped[None] == [3, 4]
