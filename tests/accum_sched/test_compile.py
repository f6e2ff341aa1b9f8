"""A user's own loop with a compiled module (docs/training.md#torchcompile): ``torch.compile(model)`` handed to the
AccumulationEngine, alone and inside DDP on 2 real gloo processes, against the plain-torch large-batch reference
(tests/cases.py). Inductor really compiles (Dynamo's graph counter moves); the schedule changes factor every epoch
and every epoch ends on a short micro-batch and a partial window.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import cases
from distributed import spawn

REGRESSION = cases.Case("compile", {0: 1, 1: 2, 2: 4}, epochs=3, samples=(22, 19))  # 6 and 5 micro-batches of 4
TOKENS = cases.Case("compile-tokens", {0: 1, 1: 3}, epochs=2, samples=(18, 18), kind="tokens")


def _train(case, rank: int, world: int):
    """The documented pattern: compile the bare module, wrap the compiled one in DDP, keep the bare one's keys."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    model = cases.make_model(case)
    compiled = torch.compile(model)
    engine = AccumulationEngine(DDP(compiled) if world > 1 else compiled, cases.make_optimizer(case, model),
                                case.schedule)
    loss_fn = cases.loss_fn_for(case.kind)
    for epoch in range(case.epochs):
        engine.train_epoch(cases.rank_batches(case, rank, epoch), loss_fn, epoch)
    return model, engine


def _graphs() -> int:
    import torch._dynamo.utils as dynamo_utils

    return int(dynamo_utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("case", (REGRESSION, TOKENS), ids=lambda c: c.kind)
def test_compiled_module_in_one_process_equals_the_large_batch_reference(case):
    before = _graphs()
    model, engine = _train(case, 0, 1)
    assert _graphs() > before  # a real compile, not an eager fallback
    ref = cases.reference(case, 1)
    assert list(model.state_dict()) == list(ref.state_dict())  # the bare module: no _orig_mod. prefix
    for got, want in zip(cases.params(model), cases.params(ref)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert engine.counters()["factor"] == cases.AccumulationSchedule(case.schedule).factor(case.epochs - 1)


def _ddp_ranks(rank: int, world: int, out: str) -> None:
    model, engine = _train(REGRESSION, rank, world)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"params": [p.tolist() for p in cases.params(model)], "graphs": _graphs(),
                   "steps": engine.counters()["optimizer_steps"]}, f)


@pytest.mark.slow
def test_ddp_of_a_compiled_module_equals_the_large_batch_reference(tmp_path):
    spawn(_ddp_ranks, 2, str(tmp_path), deadline_s=240)
    ref = cases.params(cases.reference(REGRESSION, 2))
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            seen = json.load(f)
        assert seen["graphs"] >= 1
        assert seen["steps"] == 5 + 3 + 2  # 5 micro-batches a rank (the shorter rank decides): windows 1, 2, 4
        for got, want in zip(seen["params"], ref):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
