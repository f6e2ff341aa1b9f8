"""Rank 0's progress: a throttled one-line bar on a TTY, plain lines every log_every steps otherwise; throughput over
the last log_every steps, elapsed time and an ETA from the schedule's remaining micro-batches."""
import io
import json
import os
from types import SimpleNamespace

import pytest

from accum_sched import AccumulationSchedule
from accum_sched.planning import simulate_windows
from launcher.train.metrics import (
    MetricsWriter,
    Progress,
    Throughput,
    epoch_seconds,
    eta_seconds,
    format_duration,
    planned_micro_batches,
    stream_remaining_micro_batches,
)


def info(step, epoch=0):
    return SimpleNamespace(step=step, epoch=epoch, loss=0.5, factor=2, lr=1e-3)


def test_bar_is_throttled_and_always_shows_the_last_step():
    out = io.StringIO()
    bar = Progress("bar", epochs=1, total_steps=1000, log_every=10, stream=out)
    for step in range(1, 1001):
        bar.step(info(step), effective_batch=64)
    frames = out.getvalue().split("\r")[1:]
    assert 1 <= len(frames) < 50  # a thousand fast steps, a handful of redraws
    assert "step 1000/1000" in frames[-1] and "[" + "#" * 30 + "]" in frames[-1]


def test_plain_lines_every_log_every_steps():
    out = io.StringIO()
    plain = Progress("auto", epochs=2, total_steps=25, log_every=10, stream=out)  # StringIO is no TTY
    for step in range(1, 26):
        plain.step(info(step), effective_batch=64)
    plain.epoch_end(0, 0.5, 1.0)
    lines = out.getvalue().splitlines()
    assert [line.split()[5] for line in lines[:-1]] == ["10/25", "20/25", "25/25"]
    assert lines[-1].startswith("epoch 0 of 0-1 done")


# -- throughput, elapsed time and the ETA (issue 28: progress) --------------------------------------------------
def window(step, samples, elements, micro, epoch=0):
    return SimpleNamespace(step=step, epoch=epoch, samples=samples, elements=elements, micro_batches=micro,
                           loss=0.5, factor=micro, lr=1e-3)


def test_eta_counts_remaining_micro_batches_of_a_growing_schedule_not_remaining_steps():
    # {0: 1, 2: 4} over 4 epochs of 8 micro-batches per rank: epochs 0-1 take 8 steps of 1, epochs 2-3 2 of 4
    schedule = AccumulationSchedule({0: 1, 2: 4})
    sizes = [size for _, _, size in simulate_windows(schedule, 8, 4)]
    assert sizes == [1] * 16 + [4] * 4
    planned = planned_micro_batches(sizes, max_steps=None)
    assert planned == 32
    # after 12 steps (12 micro-batches, 1.0 s each): 20 micro-batches left, whatever the steps
    done, seconds_per_micro = 12, 1.0
    eta = eta_seconds(planned - done, seconds_per_micro)
    assert eta == 20.0
    naive = (len(sizes) - 12) * 1.0  # 8 steps left at the recent 1.0 s per step
    assert naive == 8.0 and eta != naive


def test_max_steps_cuts_the_planned_micro_batches_at_that_many_windows():
    sizes = [size for _, _, size in simulate_windows(AccumulationSchedule({0: 1, 2: 4}), 8, 4)]
    assert planned_micro_batches(sizes, max_steps=18) == 16 + 4 + 4
    assert planned_micro_batches(sizes, max_steps=100) == 32  # the epochs end first
    step_keyed = AccumulationSchedule({0: 1, 3: 2}, unit="step")
    assert planned_micro_batches((s for _, _, s in simulate_windows(step_keyed, 10, 2)), 5) == 3 + 2 + 2


def test_a_stream_sums_the_scheduled_factors_of_its_remaining_steps():
    milestones = AccumulationSchedule({0: 1, 2: 4}, unit="step").milestones
    assert stream_remaining_micro_batches(milestones, 0, 6) == 1 + 1 + 4 * 4
    assert stream_remaining_micro_batches(milestones, 3, 6) == 3 * 4
    assert stream_remaining_micro_batches(((5, 2),), 0, 7) == 5 * 1 + 2 * 2  # factor 1 before the first key
    assert stream_remaining_micro_batches(milestones, 6, 6) == 0
    assert eta_seconds(None, 1.0) is None and eta_seconds(3, None) is None


def test_throughput_is_over_the_last_log_every_steps():
    clock = iter([100.0]).__next__
    speed = Throughput(window=2, tokens=True, elapsed_before=50.0, clock=clock)
    # steps at t=101 (8 samples, 80 tokens, 1 micro-batch), 103 (16, 200, 2), 107 (32, 400, 4)
    first = speed.add(window(1, 8, 80, 1), now=101.0)
    assert first["samples_per_s"] == 8.0 and first["tokens_per_s"] == 80.0 and first["elapsed_s"] == 51.0
    assert first["seconds_per_micro_batch"] == 1.0
    speed.add(window(2, 16, 200, 2), now=103.0)
    third = speed.add(window(3, 32, 400, 4), now=107.0)  # the window: steps 2 and 3, from t=101 to 107
    assert third["samples_per_s"] == pytest.approx(48 / 6) and third["tokens_per_s"] == pytest.approx(600 / 6)
    assert third["seconds_per_micro_batch"] == pytest.approx(6 / 6) and third["elapsed_s"] == 57.0
    samples_only = Throughput(window=2, tokens=False, clock=lambda: 0.0)
    assert samples_only.add(window(1, 8, 8, 1), now=2.0)["tokens_per_s"] is None


def test_the_etas_pace_leaves_compilation_out():
    """run.compile (issue 37.10): 60 s of the first step were compilation; the pace per micro-batch the ETA
    multiplies is of the training seconds only, while the rates stay of the wall-clock."""
    speed = Throughput(window=2, tokens=False, clock=lambda: 0.0)
    first = speed.add(window(1, 8, 8, 2), now=62.0, paused=60.0)  # 2 micro-batches in 2 s of training
    assert first["seconds_per_micro_batch"] == pytest.approx(1.0) and first["samples_per_s"] == round(8 / 62, 3)
    second = speed.add(window(2, 8, 8, 2), now=64.0, paused=60.0)
    assert second["seconds_per_micro_batch"] == pytest.approx(1.0)
    third = speed.add(window(3, 8, 8, 2), now=69.0, paused=63.0)  # a 3 s recompilation inside the last step
    assert third["seconds_per_micro_batch"] == pytest.approx((7 - 3) / 4)


def test_progress_lines_show_throughput_elapsed_and_eta():
    out = io.StringIO()
    plain = Progress("plain", epochs=1, total_steps=2, log_every=1, stream=out)
    plain.step(info(1), 64, {"samples_per_s": 1234.0, "tokens_per_s": 5600.0, "elapsed_s": 83.0}, eta=296.0)
    plain.step(info(2), 64, {"samples_per_s": 12.5, "tokens_per_s": None, "elapsed_s": 84.0}, eta=None)
    first, second = out.getvalue().splitlines()
    assert first.endswith("lr 0.001  1.2k samples/s  5.6k tok/s  elapsed 0:01:23  ETA 0:04:56")
    assert second.endswith("12.5 samples/s  elapsed 0:01:24  ETA -") and "tok/s" not in second
    out = io.StringIO()
    bar = Progress("bar", epochs=1, total_steps=1, log_every=1, stream=out)
    bar.step(info(1), 64, {"samples_per_s": 10.0, "tokens_per_s": None, "elapsed_s": 3700.0}, eta=7.0)
    assert "10 samples/s  elapsed 1:01:40  ETA 0:00:07" in out.getvalue()
    assert format_duration(90061) == "25:01:01"


def test_metrics_writer_returns_its_record_and_continues_elapsed_time(tmp_path):
    step = SimpleNamespace(to_dict=lambda: {"step": 1, "epoch": 0, "loss": 0.5, "lr": 1e-3, "grad_norm": None,
                                            "factor": 1})
    writer = MetricsWriter(str(tmp_path), tensorboard="off")
    assert writer.elapsed_before == 0.0
    record = writer.write(step, 32, {"samples_per_s": 4.0, "tokens_per_s": None, "elapsed_s": 12.5,
                                     "seconds_per_micro_batch": 0.1})
    writer.close()
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        assert json.loads(f.read()) == record
    assert record["elapsed_s"] == 12.5 and "seconds_per_micro_batch" not in record
    assert MetricsWriter(str(tmp_path), tensorboard="off").elapsed_before == 12.5  # a resume goes on from there


def test_epoch_seconds_from_the_elapsed_time_of_each_epochs_last_step():
    records = [{"epoch": 0, "elapsed_s": 1.0}, {"epoch": 0, "elapsed_s": 2.5}, {"epoch": 1, "elapsed_s": 6.0},
               {"epoch": 2, "elapsed_s": 7.0}]
    assert epoch_seconds(records, completed_epochs=2) == [2.5, 3.5]  # epoch 2 is not complete


def test_the_last_line_says_what_the_report_needs():
    """Issue 37.11: the README's base install has no matplotlib, which `accum-sched report` draws with: the run's
    last line names the extra to install first instead of a command that fails there."""
    from launcher.train.metrics import report_line

    assert report_line("/r/demo", matplotlib=True) == "accum-sched: see the report: accum-sched report /r/demo"
    missing = report_line("/r/my run", matplotlib=False)
    assert missing == ("accum-sched: see the report: pip install 'accum-sched[report]' (matplotlib), then "
                       "accum-sched report '/r/my run'")
