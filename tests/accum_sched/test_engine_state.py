"""The engine's construction and saved state, in one process: ``backend=`` (a back end the caller built) trains
exactly as the one the registry picks and as the plain-torch large-batch reference; what does not fit is one line;
state_dict keys are the attributes they hold; a state of an earlier development version is refused in one line."""
from __future__ import annotations

import pytest
import torch

from accum_sched import AccumulationEngine, engine_state
from accum_sched.backends.single import SingleProcessBackend
from cases import Case, loss_fn_for, make_model, make_optimizer, params, rank_batches, reference

CASE = Case("explicit-backend", {0: 2, 1: 3}, epochs=2, samples=(22,), clip=0.5)  # partial windows, clipping


def _train(explicit: bool):
    model = make_model(CASE)
    optimizer = make_optimizer(CASE, model)
    if explicit:
        backend = SingleProcessBackend(model, optimizer, precision="fp32")
        engine = AccumulationEngine(model, schedule=CASE.schedule, backend=backend, max_grad_norm=CASE.clip)
    else:
        engine = AccumulationEngine(model, optimizer, CASE.schedule, max_grad_norm=CASE.clip)
    for epoch in range(CASE.epochs):
        engine.train_epoch(rank_batches(CASE, 0, epoch), loss_fn_for(CASE.kind), epoch)
    return model, engine


def test_an_explicit_back_end_trains_as_the_detected_one_and_the_reference():
    want = params(reference(CASE, 1))
    for explicit in (True, False):
        model, engine = _train(explicit)
        assert type(engine.backend) is SingleProcessBackend and engine.precision == "fp32"
        for got, ref in zip(params(model), want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_what_does_not_fit_an_explicit_or_detected_back_end_is_one_line():
    model = make_model(CASE)
    optimizer = make_optimizer(CASE, model)
    backend = SingleProcessBackend(model, optimizer, precision="bf16")
    cases = [
        (lambda: AccumulationEngine(model, optimizer, backend=backend), TypeError,
         "optimizer belong to the back end when backend= is given: pass them to SingleProcessBackend(...)"),
        (lambda: AccumulationEngine(model, backend=backend, gradient_sync="boundary"), TypeError,
         "gradient_sync belong to the back end when backend= is given"),
        (lambda: AccumulationEngine(model, backend=backend, precision="fp16"), ValueError,
         "precision='fp16' but the back end was built with precision='bf16': give it once, to the back end"),
        (lambda: AccumulationEngine(model, optimizer, gradient_sync="every_micro_batch"), TypeError,
         "gradient_sync= is not an option of the one process back end (SingleProcessBackend), chosen for this "
         "model; it takes precision, count_allreduce"),
        (lambda: AccumulationEngine(model, optimizer, precision="fp8"), ValueError,
         "precision='fp8' is not one of fp32, bf16, fp16"),
    ]
    for make, kind, message in cases:
        with pytest.raises(kind) as info:
            make()
        assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
    assert AccumulationEngine(model, backend=backend, precision="bf16").precision == "bf16"  # the same: fine
    assert AccumulationEngine(model, backend=backend).precision == "bf16"  # taken from the back end


def test_state_keys_are_the_attributes_they_hold():
    _, engine = _train(explicit=False)
    state = engine.state_dict()
    assert set(state) == set(engine_state.KEYS)  # no noise scale, no open window
    for key in engine_state.COUNTERS + ("factor", "world_size", "allreduce_rounds"):
        assert state[key] == getattr(engine, key), key
    assert state["epoch_index"] == CASE.epochs and state["micro_in_epoch"] == 0
    assert state["micro_steps"] == engine.counters()["micro_batches"] == 2 * 6
    assert state["schedule"] == [[0, 2], [1, 3]] and state["schedule_unit"] == "epoch"
    fresh = AccumulationEngine(make_model(CASE), make_optimizer(CASE, make_model(CASE)), CASE.schedule)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def test_a_state_of_an_earlier_development_version_is_one_line():
    _, engine = _train(explicit=False)
    before = engine.state_dict()
    old = {"epoch": 2, "micro_batch": 0, "optimizer_steps": 10, "micro_batches": 12, "elements": 22, "factor": 3,
           "world_size": 1, "schedule": [[0, 2], [1, 3]], "unit": "epoch", "backend": {}}
    with pytest.raises(ValueError) as info:
        engine.load_state_dict(old)
    message = str(info.value)
    assert message.startswith("the engine state lacks epoch_index, micro_in_epoch, skipped_steps")
    assert "\n" not in message
    assert "written by an earlier development version of accum_sched" in message
    assert engine.state_dict() == before  # nothing was loaded before the refusal
