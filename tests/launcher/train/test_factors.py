"""launcher/train/factors.py: the one place the factor a run trains with is built, from the config's schedule (or
global_batch), schedule_from's conversion, the resume plan's rescaling and the adaptive factor."""
from __future__ import annotations

from accum_sched.schedule import AccumulationSchedule
from accum_sched.schedule_from import Converted
from launcher.checkpoint.resume import ResumePlan
from launcher.config import validate
from launcher.train.factors import run_factors

BASE = {"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 8}}


def config(**accumulation):
    return validate(dict(BASE, accumulation=accumulation))


def test_the_written_schedule_is_what_the_engine_follows_and_the_plan_counts():
    f = run_factors(config(schedule={0: 1, 2: 4}), 2, ResumePlan())
    assert f.schedule == f.engine == f.planned == AccumulationSchedule({0: 1, 2: 4})


def test_global_batch_gives_the_factor_of_the_world():
    assert run_factors(config(global_batch=64), 2, ResumePlan()).engine == AccumulationSchedule(4)  # 64 / (8 x 2)
    assert run_factors(config(global_batch=64), 4, ResumePlan()).engine == AccumulationSchedule(2)


def test_a_resume_on_another_world_rescales_and_a_conversion_replaces_the_written_schedule():
    kept = ResumePlan(scale=(2, 1))  # keep_global_batch from 2 workers to 1
    assert run_factors(config(schedule={0: 1, 2: 4}), 1, kept).engine == AccumulationSchedule({0: 2, 2: 8})

    converted = Converted(AccumulationSchedule({0: 1, 10: 3}, "step"), lr=(1.0,) * 12, factors=(1,) * 10 + (3,) * 2,
                          starts=tuple(range(10)) + (10, 13))
    f = run_factors(config(schedule={0: 1, 2: 4}), 2, kept, converted)
    assert f.engine == f.planned == AccumulationSchedule({0: 2, 10: 6}, "step")


def test_an_adaptive_factor_starts_the_engine_at_one_and_plans_every_window_at_min_factor():
    f = run_factors(config(schedule={0: 1, 2: 4}), 2, ResumePlan(), adaptive={"min_factor": 2, "max_factor": 8})
    assert f.engine == 1 and f.planned == AccumulationSchedule(2)
    assert f.schedule == AccumulationSchedule({0: 1, 2: 4})  # reported as written
