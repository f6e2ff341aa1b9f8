"""A second AccumulationEngine on the same DDP model (issue 28, item 5). DDP takes one comm hook per model, for good:
the second engine takes the first one's hook over (accum_sched/backends/ddp_hook.py: install) instead of falling
back to a small all-reduce of its own per step with a warning. On 2 gloo ranks, judged by the test's own collective
counter (tests/counters.py) and the plain-torch large-batch reference:

* the run that switches engines after epoch 0 (the same model and optimizer) equals the large-batch reference;
* every optimizer step of the second engine launches one collective, DDP's bucket all-reduce carrying the window's
  numbers, and no small all-reduce of its own; no warning; its counters start at its own first step;
* a third engine built with count_allreduce=False still drives the registered hook (it cannot be removed and sums
  without dividing) and stays exact;
* the first engine, used again, stops with a one-line HookTakenOver error before its first forward (its epoch's
  agreement, the same on every rank, is the only collective it launches).
"""
from __future__ import annotations

import json

import pytest
import torch

import cases
from counters import CollectiveCounter
from distributed import attempt, spawn

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

CASE = cases.Case("second-engine", {0: 1, 1: 2, 2: 3}, epochs=3, samples=(37, 39), clip=0.3)


def _rank(rank: int, world: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    model = cases.make_model(CASE)
    wrapped = DDP(model)
    optimizer = cases.make_optimizer(CASE, model)
    loss_fn = cases.loss_fn_for(CASE.kind)
    report = {}
    first = AccumulationEngine(wrapped, optimizer, CASE.schedule, max_grad_norm=CASE.clip)
    first.train_epoch(cases.rank_batches(CASE, rank, 0), loss_fn, 0)
    report["first_steps"] = first.optimizer_steps

    built = attempt(lambda: AccumulationEngine(wrapped, optimizer, CASE.schedule, max_grad_norm=CASE.clip))
    second = built.pop("result")
    report["built"] = built
    steps = []
    with CollectiveCounter() as colls:
        mark = [0]

        def on_step(info):
            steps.append([list(c) + [g] for c, g in zip(colls.calls[mark[0]:], colls.groups[mark[0]:])])
            mark[0] = len(colls.calls)

        second.on_step(on_step)
        for epoch in (1, 2):
            second.train_epoch(cases.rank_batches(CASE, rank, epoch), loss_fn, epoch)
    report["steps"] = steps
    report["all"] = [list(c) + [g] for c, g in zip(colls.calls, colls.groups)]
    report["second"] = {"optimizer_steps": second.optimizer_steps, "rounds": second.allreduce_rounds}
    torch.save(cases.params(model), f"{out_dir}/params-{rank}.pt")

    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    with CollectiveCounter() as again:
        reuse = attempt(lambda: first.train_epoch(cases.rank_batches(CASE, rank, 2), loss_fn, 2))
    report["reuse"] = {"error": reuse["error"], "collectives": again.calls,
                       "grads_kept": all((a is None and p.grad is None) or torch.equal(a, p.grad)
                                         for a, p in zip(grads, model.parameters()))}
    # a third engine that asks for no hook still drives the one registered (it sums; DDP cannot remove it): one
    # more epoch with it equals one more epoch of the reference
    third = AccumulationEngine(wrapped, optimizer, CASE.schedule, max_grad_norm=CASE.clip, count_allreduce=False)
    third.train_epoch(cases.rank_batches(CASE, rank, 3), loss_fn, 3)
    report["third_rounds"] = third.allreduce_rounds
    torch.save(cases.params(model), f"{out_dir}/params3-{rank}.pt")
    with open(f"{out_dir}/report-{rank}.json", "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("second-engine")
    spawn(_rank, 2, str(out), deadline_s=240)
    return out, [json.loads((out / f"report-{r}.json").read_text()) for r in range(2)]


def test_second_engine_equals_the_large_batch_reference(ranks):
    out, _ = ranks
    want = cases.params(cases.reference(CASE, 2))
    for rank in range(2):
        got = torch.load(out / f"params-{rank}.pt")
        for g, w in zip(got, want):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (rank, (g - w).abs().max())


def test_engine_without_hook_drives_the_registered_one(ranks):
    out, reports = ranks
    case4 = cases.Case(CASE.name, CASE.schedule, epochs=4, samples=CASE.samples, clip=CASE.clip)
    want = cases.params(cases.reference(case4, 2))
    for rank in range(2):
        assert reports[rank]["third_rounds"] > 0
        for g, w in zip(torch.load(out / f"params3-{rank}.pt"), want):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (rank, (g - w).abs().max())


def test_second_engine_takes_the_hook_over_one_collective_per_step(ranks):
    _, reports = ranks
    params = sum(p.numel() for p in cases.make_model(CASE).parameters())
    for report in reports:
        assert report["built"]["error"] is None and report["built"]["warnings"] == []
        steps = report["steps"]
        assert len(steps) == report["second"]["optimizer_steps"] == report["second"]["rounds"] > 0
        for colls in steps:
            # DDP's bucket all-reduce, carrying the window's numbers after the gradient: nothing of the engine's own
            grads = [c for c in colls if c[0] == "all_reduce" and c[1] > params]
            assert len(grads) == 1, colls
        small = [c for c in report["all"] if c[1] <= params]
        assert len(small) <= 2, small  # at most the once-per-epoch agreement of each of its 2 epochs


def test_first_engine_used_again_says_so_before_any_collective(ranks):
    _, reports = ranks
    for report in reports:
        kind, message = report["reuse"]["error"]
        assert kind == "HookTakenOver" and "taken over by a later AccumulationEngine" in message, message
        assert "\n" not in message
        # the epoch's agreement (the same on every rank) at most: no forward, no backward, no gradient all-reduce
        assert len(report["reuse"]["collectives"]) <= 1 and report["reuse"]["grads_kept"], report["reuse"]
