"""The accumulation factor a run trains with, built in one place: the Trainer asks here and nowhere else.

Four settings decide it, in this order: the config's schedule at this world size (``accumulation.schedule``, or the
constant factor of ``accumulation.global_batch``: ``Config.schedule_for``); ``accumulation.schedule_from``'s
converted schedule in its place; the resume plan's rescaling (``checkpoint.on_world_change``: keep_global_batch or
keep_factor, launcher/checkpoint/resume.py); and ``accumulation.adaptive``, under which the engine starts at 1 and
decides the factor itself, so the plan counts every window at ``min_factor`` (an upper bound of the steps).
"""
from __future__ import annotations

from dataclasses import dataclass

from accum_sched.schedule import AccumulationSchedule


@dataclass(frozen=True)
class RunFactors:
    """``schedule``: the written (or converted) schedule, rescaled for the resume: what the run reports and, without
    an adaptive factor, follows. ``engine``: what the AccumulationEngine is handed. ``planned``: what the LR
    scheduler's total and the progress display plan with."""

    schedule: AccumulationSchedule
    engine: AccumulationSchedule | int
    planned: AccumulationSchedule


def run_factors(cfg, world: int, plan, converted=None, adaptive: dict | None = None) -> RunFactors:
    """The factors of ``cfg`` on ``world`` ranks. ``plan``: the run's ResumePlan; ``converted``: schedule_from's
    converted run, or None; ``adaptive``: ``accumulation.adaptive`` with its defaults, or None."""
    written = cfg.schedule_for(world) if converted is None else converted.schedule
    schedule = plan.schedule(written)
    if adaptive is None:
        return RunFactors(schedule=schedule, engine=schedule, planned=schedule)
    return RunFactors(schedule=schedule, engine=1, planned=AccumulationSchedule(adaptive["min_factor"]))
