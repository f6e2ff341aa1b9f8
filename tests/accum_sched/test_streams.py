"""Streams: an iterable without ``len()`` (and no ``num_batches``) trains exactly like the large-batch reference.

Every rank's stream is a generator over the same micro-batches the map-style tests use (tests/cases.py), so the
reference is the same plain-torch one: per window, one large batch of every rank's micro-batches, the epoch ending
at the shortest rank's last micro-batch. Checked on every rank (allclose to the reference, bitwise equal to rank 0),
at 2 and 3 ranks, with partial windows, schedule changes, token counts and streams of unequal length; the collectives
are counted by the tests' own counter (tests/counters.py): per epoch one small side-group all-reduce of the first
``read_ahead + 1`` reads' flags, then none while every rank holds what it read at a boundary (the flag rides in the
window's numbers), one where the shortest stream's end comes into view, and one per ``read_ahead`` reads inside a
window longer than that (:func:`_expected_flag_collectives` counts them from the protocol's rules); none for a sized
loader; a stop inside a window and a resume from ``state_dict()`` on a stream.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import cases
from counters import CollectiveCounter
from distributed import attempt, spawn

# unequal stream lengths: 40/4 = 10, 30/4 -> 8, 38/4 -> 10 micro-batches; the epoch ends after the shortest's 8th
UNEVEN = cases.Case("uneven-streams", {0: 3, 1: 5}, epochs=2, samples=(40, 30, 38), optimizer="adamw", clip=0.5)
STREAM_CASES = cases.CASES + [UNEVEN]
STOP = cases.Case("stop-in-window", {0: 2, 1: 3}, epochs=3, samples=(37, 39, 38), optimizer="adamw")


def stream(case, rank, epoch):
    """The micro-batches of ``rank`` in ``epoch`` as a generator: no len(), read one at a time."""
    yield from cases.rank_batches(case, rank, epoch)


def _train(case, rank, world, engine, *, sized=False, start=0):
    loss_fn = cases.loss_fn_for(case.kind)
    for epoch in range(start, case.epochs):
        batches = cases.rank_batches(case, rank, epoch) if sized else stream(case, rank, epoch)
        engine.train_epoch(batches, loss_fn, epoch)
        if engine.should_stop:
            return


def _engine(case, world, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    model = cases.make_model(case)
    wrapped = DDP(model, find_unused_parameters=case.kind == "unused") if world > 1 else model
    return model, AccumulationEngine(wrapped, cases.make_optimizer(case, model), case.schedule,
                                     max_grad_norm=case.clip, **kwargs)


def _resumed_engine(case, world, stopped_engine, stopped_model, **kwargs):
    """A new model and engine holding what a stopped one saved (its state_dict, the model's, the optimizer's), as a
    resume in a new process would."""
    state = {"engine": stopped_engine.state_dict(), "model": stopped_model.state_dict(),
             "optimizer": stopped_engine.backend.optimizer.state_dict()}
    model, engine = _engine(case, world, **kwargs)
    model.load_state_dict(state["model"])
    engine.backend.optimizer.load_state_dict(state["optimizer"])
    engine.load_state_dict(state["engine"])
    return model, engine


def _counted(case, rank, world, sized=False, **kwargs):
    model, engine = _engine(case, world, **kwargs)
    with CollectiveCounter() as colls:
        _train(case, rank, world, engine, sized=sized)
    ahead = engine.read_ahead
    # the tests' own count of the side-group all-reduces of has-flags, by size: [has, -has] per read (nothing else
    # runs on the side group here: no stop poll)
    later = sum(1 for (name, numel), group in zip(colls.calls, colls.groups)
                if name == "all_reduce" and group == "other" and numel in range(2, 2 * ahead + 1, 2)) \
        if world > 1 else 0
    first = sum(1 for (name, numel), group in zip(colls.calls, colls.groups)
                if name == "all_reduce" and group == "other" and numel == 2 * (ahead + 1)) if world > 1 else 0
    return model, engine, {"flags_later": later, "flags_first": first, "read_ahead": ahead,
                           "counters": engine.counters()}


def _ranks(rank: int, world: int, out_dir: str) -> None:
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in STREAM_CASES:
            def run(case=case):
                model, engine, counts = _counted(case, rank, world)
                torch.save(cases.params(model), os.path.join(out_dir, f"{case.name}-{rank}.pt"))
                return counts

            results[case.name] = attempt(run)

        def sized():
            return _counted(cases.CASES[0], rank, world, sized=True)[2]

        results["sized"] = attempt(sized)

        def stopped_and_resumed():  # a stop inside a window (launcher's stop_at), a new engine from state_dict()
            model, engine = _engine(STOP, world, stop_at="micro_batch")
            engine.on_step(lambda info: engine.request_stop() if info.step == 6 else None)
            _train(STOP, rank, world, engine)
            stopped = [engine.epoch_index, engine.micro_in_epoch, engine.window_open]
            model, engine = _resumed_engine(STOP, world, engine, model, stop_at="micro_batch")
            _train(STOP, rank, world, engine, start=engine.epoch_index)  # each stream from its start: skip=True
            torch.save(cases.params(model), os.path.join(out_dir, f"stop-{rank}.pt"))
            return {"stopped": stopped}

        results["stop"] = attempt(stopped_and_resumed)
    torch.save(results, os.path.join(out_dir, f"results-{rank}.pt"))


def _micro_batches_per_epoch(case, world):
    return [min(len(cases.rank_batches(case, r, epoch)) for r in range(world)) for epoch in range(case.epochs)]


def _expected_flag_collectives(n: int, factor: int, ahead: int) -> int:
    """Side-group all-reduces of has-flags in an epoch of ``n`` micro-batches (the shortest rank's) at ``factor``,
    from the protocol's rules (accum_sched/streams.py): the first ``ahead + 1`` reads take one; at a window's end
    that is not the epoch's, the reader tops what it holds up to ``ahead + 1`` and the reads' flag rides in the
    window's numbers, costing one all-reduce only where they reach past the shortest stream's end (then the end is
    known and nothing more is read); inside a window, holding one, ``ahead`` more reads take one."""
    held, count = ahead + 1, 1
    end_known = held > n
    for i in range(n - 1):  # micro-batch i handed out (the last one reads nothing)
        held -= 1
        if (i + 1) % factor == 0:  # a boundary
            reads = ahead + 1 - held
            if reads > 0 and not end_known:
                held += reads
                if i + held >= n:  # a read past the end on some rank: the exact all-reduce of the batch's flags
                    count, end_known = count + 1, True
        elif held <= 1 and not end_known:
            held, count = held + ahead, count + 1
            end_known = i + held >= n
    return count


def _steps(case, world):
    from accum_sched.schedule import AccumulationSchedule

    schedule = AccumulationSchedule(case.schedule)
    return sum(-(-n // schedule.factor(epoch)) for epoch, n in enumerate(_micro_batches_per_epoch(case, world)))


def _check(out_dir, world):
    results = [torch.load(os.path.join(out_dir, f"results-{r}.pt")) for r in range(world)]
    for case in STREAM_CASES:
        ref = cases.params(cases.reference(case, world))
        first = torch.load(os.path.join(out_dir, f"{case.name}-0.pt"))
        micro = _micro_batches_per_epoch(case, world)
        for rank in range(world):
            what = f"{case.name} (rank {rank} of {world})"
            result = results[rank][case.name]
            assert result["error"] is None, (what, result["error"])
            got = torch.load(os.path.join(out_dir, f"{case.name}-{rank}.pt"))
            for g, r in zip(got, ref, strict=True):
                torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5, msg=lambda m, what=what: f"{what}: {m}")
            for g, f in zip(got, first, strict=True):
                assert torch.equal(g, f), f"{what}: differs from rank 0"
            counters = result["result"]["counters"]
            assert counters["micro_batches"] == sum(micro), (what, counters, micro)
            assert counters["optimizer_steps"] == _steps(case, world), (what, counters)
            if world > 1:
                assert counters["allreduce_rounds"] == counters["optimizer_steps"], (what, counters)
                # the tests' own count: per epoch one all-reduce of the first R + 1 reads' flags, then the ones
                # the rules give (R = read_ahead, the engine's default 4)
                flags = result["result"]
                ahead = flags["read_ahead"]
                assert ahead == 4, flags
                assert flags["flags_first"] == case.epochs, (what, flags)
                from accum_sched.schedule import AccumulationSchedule

                factors = [AccumulationSchedule(case.schedule).factor(e) for e in range(case.epochs)]
                expected = [_expected_flag_collectives(n, f, ahead) - 1 for n, f in zip(micro, factors)]
                assert flags["flags_later"] == sum(expected), (what, flags, micro, factors, expected)
                # where the factor is at most R, at most one per epoch: the boundaries' reads ride for free
                assert all(e <= 1 for e, f in zip(expected, factors) if f <= ahead), expected
                assert counters["stream_collectives"] == flags["flags_first"] + flags["flags_later"], (what, flags)
                warned = [w for w in result["warnings"] if "streams end at different points" in w]
                # 'truncate' (the default): a warning on rank 0 only, once per epoch whose streams differ in length
                uneven = sum(len({len(cases.rank_batches(case, r, e)) for r in range(world)}) > 1
                             for e in range(case.epochs))
                assert len(warned) == (uneven if rank == 0 else 0), (what, warned)
        if case is UNEVEN and world > 1:
            assert len(results[0][case.name]["warnings"]) > 0  # the check above can see a warning
    for rank in range(world):
        sized = results[rank]["sized"]
        assert sized["error"] is None, sized["error"]
        assert sized["result"]["flags_first"] == sized["result"]["flags_later"] == 0, sized["result"]
        assert sized["result"]["counters"]["stream_collectives"] == 0
        stop = results[rank]["stop"]
        assert stop["error"] is None, stop["error"]
        epoch, micro_in_epoch, window_open = stop["result"]["stopped"]
        assert window_open and micro_in_epoch > 0, stop["result"]  # stopped inside a window, inside an epoch
        ref = cases.params(cases.reference(STOP, world))
        for g, r in zip(torch.load(os.path.join(out_dir, f"stop-{rank}.pt")), ref, strict=True):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # world 3: the slow tier
def test_streams_match_the_large_batch_reference_on_every_rank(tmp_path, world):
    spawn(_ranks, world, str(tmp_path), deadline_s=300)
    _check(str(tmp_path), world)


def test_single_process_stream_matches_the_reference(tmp_path):
    _ranks(0, 1, str(tmp_path))
    _check(str(tmp_path), 1)


def _uneven_error(rank: int, world: int, out_dir: str) -> None:
    def run():
        _, engine = _engine(UNEVEN, world, uneven="error")
        _train(UNEVEN, rank, world, engine)

    torch.save(attempt(run), os.path.join(out_dir, f"error-{rank}.pt"))


@pytest.mark.slow
def test_uneven_streams_raise_on_every_rank_under_uneven_error(tmp_path):
    spawn(_uneven_error, 3, str(tmp_path), deadline_s=120)  # a rank left waiting would hang: bounded
    for rank in range(3):
        result = torch.load(os.path.join(tmp_path, f"error-{rank}.pt"))
        assert result["error"] is not None, rank
        kind, message = result["error"]
        assert kind == "RankDisagreement" and "streams end at different points" in message, result["error"]
        assert "uneven='truncate'" in message, message  # the fix is named


def _uneven_after_resume(rank: int, world: int, out_dir: str) -> None:
    """Stop after step 1 of epoch 0 (3 micro-batches at factor 3), then a new engine resumes it from a stream that
    starts at the resume point (skip=False, as the launcher's loaders do)."""
    def run():
        model, engine = _engine(UNEVEN, world, uneven="error", stop_at="micro_batch")
        engine.on_step(lambda info: engine.request_stop() if info.step == 1 else None)
        _train(UNEVEN, rank, world, engine)
        model, engine = _resumed_engine(UNEVEN, world, engine, model, uneven="error")
        rest = iter(cases.rank_batches(UNEVEN, rank, 0)[engine.micro_in_epoch:])
        engine.train_epoch((batch for batch in rest), cases.loss_fn_for(UNEVEN.kind), 0, skip=False)

    torch.save(attempt(run), os.path.join(out_dir, f"resumed-{rank}.pt"))


def test_the_uneven_message_counts_the_epochs_micro_batches_after_a_resume(tmp_path):
    """Issue 37.12: epoch 0's streams hold 10, 8 and 10 micro-batches; resumed after 3 of them, the message names
    micro-batch 8 of the epoch (the first some rank lacks), not 5 counted from the resume point."""
    spawn(_uneven_after_resume, 3, str(tmp_path), deadline_s=120)
    for rank in range(3):
        result = torch.load(os.path.join(tmp_path, f"resumed-{rank}.pt"))
        assert result["error"] is not None, rank
        kind, message = result["error"]
        assert kind == "RankDisagreement" and "(micro-batch 8 of the epoch is on some ranks only)" in message, message


def test_truncation_warns_once_on_rank_zero():
    """One process: nothing to disagree with, so no warning and no collective; the stream's end is its own."""
    _, engine = _engine(UNEVEN, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(UNEVEN, 0, 1, engine)
    assert not [w for w in caught if "streams end" in str(w.message)]
    assert engine.stream_collectives == 0
    assert engine.micro_steps == sum(len(cases.rank_batches(UNEVEN, 0, e)) for e in range(UNEVEN.epochs))
