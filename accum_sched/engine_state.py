"""What ``AccumulationEngine.state_dict()`` holds: each counter under the name of the engine attribute it is.

==================  =======================================================================================
key                 what
==================  =======================================================================================
``epoch_index``     the epoch to run next (or running)
``micro_in_epoch``  micro-batches of that epoch already trained
``optimizer_steps`` / ``skipped_steps`` / ``overflow_steps``: steps taken, skipped (non-finite), fp16 overflows
``micro_steps``     micro-batches run on this rank
``elements``        elements (samples or tokens) over all ranks; ``samples`` likewise
``allreduce_rounds`` gradient collective rounds so far (0 where not counted)
``factor``          the current window's factor; ``world_size``: the ranks it was saved on
``schedule``        the schedule's milestones, ``schedule_unit`` its unit (for reading a checkpoint)
``backend``         the back end's own state; ``noise_scale`` / ``adaptive``: the EMAs and the controller, if on
``window``          only after a stop inside a window: this rank's open window (accum_sched.open_window)
==================  =======================================================================================

A state without these keys was written by an earlier development version: :func:`check_format` says so in one line.
"""
from __future__ import annotations

#: the counters, restored as ints (allreduce_rounds is restored as an offset to the back end's own count)
COUNTERS = ("epoch_index", "micro_in_epoch", "optimizer_steps", "skipped_steps", "overflow_steps", "micro_steps",
            "elements", "samples")
KEYS = COUNTERS + ("allreduce_rounds", "factor", "world_size", "schedule", "schedule_unit", "backend")


def check_format(state: dict) -> None:
    """One ValueError line when ``state`` is not an engine state_dict of this version."""
    missing = [key for key in KEYS if key not in state]
    if missing:
        raise ValueError(f"the engine state lacks {', '.join(missing)}: it was written by an earlier development "
                         f"version of accum_sched and cannot be resumed; start afresh")


def save(engine) -> dict:
    """``engine``'s state (call between windows, or after a stop inside one)."""
    state = {key: getattr(engine, key) for key in COUNTERS + ("factor", "world_size")}
    state.update(allreduce_rounds=engine.allreduce_rounds or 0,
                 schedule=[list(m) for m in engine.schedule.milestones], schedule_unit=engine.schedule.unit,
                 backend=engine.backend.state_dict(), **({} if engine.noise is None else engine.noise.state_dict()))
    if engine.window_open:
        state["window"] = engine.window.state_dict(engine._prescale, engine.backend.local_grads())
    return state


def load(engine, state: dict) -> None:
    """Put ``state`` back into ``engine`` (its factor and stop flags are the engine's to reset)."""
    check_format(state)
    for key in COUNTERS:
        setattr(engine, key, int(state[key]))
    engine._rounds_offset = int(state["allreduce_rounds"]) - (engine.backend.allreduce_rounds or 0)
    if engine.noise is not None:
        engine.noise.load_state_dict(state)
    engine.backend.load_state_dict(state["backend"])
    grads = engine.window.load_state_dict(state.get("window"))
    if grads is not None:
        engine.backend.load_local_grads(grads)


__all__ = ["COUNTERS", "KEYS", "check_format", "load", "save"]
