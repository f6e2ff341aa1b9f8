"""Costs that grow with what remains, not with what was done (issue: O(1) resume, one-pass planning, preemption
within a micro-batch):

- the engine stops inside a window at about one micro-batch after a stop request (on one rank only), every rank at
  the same micro-batch; its per-rank state_dict holds the open window; a fresh engine resumed from it with a
  positioned loader (skip=False) ends with the parameters of the uninterrupted run and of the large-batch reference
  (single process and 2-rank DDP);
- token-keyed planning loads every sample once (not epochs x world times) and gives the totals the old
  collate-every-shard method gave;
- `accum-sched run` gets SIGTERM 1 s into a 6.4 s window: it forwards it, the workers commit a checkpoint holding
  the open window within about 4 s and exit with the documented status; the resume loads only what remains and ends
  equal to the uninterrupted run.
"""
from __future__ import annotations

import copy
import os
import sys

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from cases import Case, loss_fn_for, make_model, make_optimizer, params, rank_batches, reference, run_engine  # noqa: E402
from distributed import attempt, spawn  # noqa: E402

CASE = Case("stop-mid-window", {0: 3, 1: 5}, epochs=3, samples=(40, 40), optimizer="adamw")  # 10 micro-batches
STOP_EPOCH, STOP_AT = 1, 2  # request during micro-batch 2 of epoch 1 (inside its first window of 5)


def interrupted_then_resumed(rank, world, requesting_rank=0, skip=False):
    """Train CASE, stop on a request (made on one rank), save, resume in a fresh engine; return what happened."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    def build():
        model = make_model(CASE)
        wrapped = DDP(model) if world > 1 else model
        optimizer = make_optimizer(CASE, model)
        return model, optimizer, AccumulationEngine(wrapped, optimizer, CASE.schedule, stop_at="micro_batch")

    loss_fn = loss_fn_for(CASE.kind)
    model, optimizer, engine = build()
    for epoch in range(CASE.epochs):
        for i, batch in enumerate(engine.micro_batches(rank_batches(CASE, rank, epoch), epoch)):
            if (epoch, i) == (STOP_EPOCH, STOP_AT) and rank == requesting_rank:
                engine.request_stop()
            engine.backward(*loss_fn(engine.model, batch))
        if engine.should_stop:
            break
    stopped = {"epoch": engine.epoch_index, "micro": engine.micro_in_epoch, "open": engine.window_open,
               "steps": engine.optimizer_steps}
    saved = copy.deepcopy({"engine": engine.state_dict(), "model": model.state_dict(),
                           "optimizer": optimizer.state_dict()})
    del engine
    model, optimizer, engine = build()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    engine.load_state_dict(saved["engine"])
    for epoch in range(engine.epoch_index, CASE.epochs):
        batches = rank_batches(CASE, rank, epoch)
        loader = batches if skip else batches[engine.resume_offset(epoch):]
        engine.train_epoch(loader, loss_fn, epoch, skip=skip)
    return stopped, params(model), engine.optimizer_steps


def check_stop_and_resume(rank, world, results):
    outcome = attempt(lambda: interrupted_then_resumed(rank, world, requesting_rank=world - 1))
    outcome["plain"] = params(run_engine(CASE, rank, world)[0])
    results[rank] = outcome


def assert_resumed_equal(stopped, resumed, steps, plain, world):
    # requested during micro-batch 2, read after micro-batch 3's backward in DDP (one micro-batch later) or at
    # once in one process; epoch 1 begins with a window of 5, so both stop inside it, after step 4 (epoch 0: 10/3)
    assert stopped == {"epoch": 1, "micro": STOP_AT + (2 if world > 1 else 1), "open": True, "steps": 4}
    assert steps == 4 + 2 + 2  # epochs 1 and 2: windows of 5
    for got, want in zip(resumed, plain):
        assert torch.equal(got, want)  # the same sums in the same order
    for got, want in zip(resumed, params(reference(CASE, world))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_engine_stops_inside_a_window_and_resumes_exactly_single_process():
    plain = params(run_engine(CASE, 0, 1)[0])
    for skip in (False, True):  # positioned loader, or the engine skipping (loads what it skips)
        stopped, resumed, steps = interrupted_then_resumed(0, 1, skip=skip)
        assert_resumed_equal(stopped, resumed, steps, plain, 1)


def test_engine_stops_inside_a_window_and_resumes_exactly_ddp():
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        spawn(check_stop_and_resume, 2, results, deadline_s=240)
        results = dict(results)
    for rank in range(2):
        assert results[rank]["error"] is None, results[rank]["error"]
        stopped, resumed, steps = results[rank]["result"]
        assert_resumed_equal(stopped, resumed, steps, results[rank]["plain"], 2)
