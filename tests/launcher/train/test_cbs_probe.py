"""`accum-sched cbs` (issue 27.3): branches per factor from one checkpoint over the same samples.

- the factor-1 branch of a factor-1 run at a constant LR continues that run bit for bit: its metrics lines equal
  the original's next steps (same weights, optimizer state, data order and RNG: the branches start from the
  checkpoint's state, not from a re-initialised model);
- every branch reads the same number of samples, each in its own directory, with the factor asked for;
- the report's critical factor is the largest whose loss is within the tolerance of the best (recomputed here);
- --apply writes the schedule; a second call reruns nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 3}}
task: {{target: "faulty_tasks:regression"}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: {{0: 1}}}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 8, keep_last: 10}}
logging: {{progress: plain, tensorboard: "off"}}
"""


def accum(*args, expect=0):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + TESTS + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=600)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def lines(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cbs")
    cfg = tmp / "run.yaml"
    cfg.write_text(CONFIG.format(out=tmp / "run"))
    accum("run", str(cfg))
    checkpoint = tmp / "run" / "checkpoints" / "step-00000016"  # end of epoch 0
    out = accum("cbs", str(cfg), "--from", str(checkpoint), "--factors", "1,2,4", "--samples", "128",
                "--tolerance", "0.05", "--apply")
    return tmp, cfg, checkpoint, out.stdout


def test_the_factor_1_branch_continues_the_run_bit_for_bit(probe):
    tmp, *_ = probe
    original = {m["step"]: m for m in lines(tmp / "run")}
    branch = lines(tmp / "run" / "cbs" / "factor-1")
    assert [m["step"] for m in branch] == list(range(17, 25))  # 128 samples = 8 steps of 2 x 8
    for m in branch:
        want = original[m["step"]]
        assert (m["loss"], m["lr"], m["samples"]) == (want["loss"], want["lr"], want["samples"]), m["step"]


def test_every_branch_reads_the_same_samples_at_its_factor(probe):
    tmp, *_ = probe
    for factor, steps in ((1, 8), (2, 4), (4, 2)):
        branch = lines(tmp / "run" / "cbs" / f"factor-{factor}")
        assert len(branch) == steps and {m["factor"] for m in branch} == {factor}
        assert sum(m["samples"] for m in branch) == 128
        assert branch[0]["step"] == 17


def test_the_report_names_the_critical_factor_and_applies_it(probe):
    tmp, cfg, checkpoint, stdout = probe
    report = json.loads((tmp / "run" / "cbs" / "cbs.json").read_text())
    best = min(b["loss"] for b in report["branches"])
    want = max(b["factor"] for b in report["branches"] if b["loss"] <= best * 1.05)
    assert report["critical_factor"] == want and f"critical factor: {want}" in stdout
    applied = yaml.safe_load((tmp / "run" / "cbs" / "schedule.yaml").read_text())
    assert applied == {"accumulation": {"unit": "step", "schedule": {0: 1, 16: want}}}
    again = accum("cbs", str(cfg), "--from", str(checkpoint), "--factors", "1,2,4", "--samples", "128")
    assert "steps from step" not in again.stdout  # finished branches are read, not rerun


def test_bad_probe_arguments_exit_2(probe):
    tmp, cfg, checkpoint, _ = probe
    bad = accum("cbs", str(cfg), "--from", str(checkpoint), "--factors", "0,x", "--samples", "8", expect=2)
    assert bad.stderr.startswith("error: --factors:")
    many = accum("cbs", str(cfg), "--from", str(checkpoint), "--samples", "100000", expect=2)
    assert many.stderr.startswith("error: --samples:")


def test_branches_hold_the_checkpoints_learning_rate_under_a_decaying_schedule(tmp_path):
    cfg = tmp_path / "cos.yaml"
    cfg.write_text(CONFIG.format(out=tmp_path / "cos").replace("distributed:", "lr_scheduler: {name: cosine}\n"
                                                                               "distributed:"))
    accum("run", str(cfg))
    original = {m["step"]: m for m in lines(tmp_path / "cos")}
    accum("cbs", str(cfg), "--from", str(tmp_path / "cos" / "checkpoints" / "step-00000016"), "--factors", "1,2",
          "--samples", "64")
    held = original[17]["lr"]  # what the optimizer held after step 16: the LR of step 17
    assert original[20]["lr"] < held  # the original run decays on
    for factor in (1, 2):
        branch = lines(tmp_path / "cos" / "cbs" / f"factor-{factor}")
        assert branch and all(m["lr"] == pytest.approx(held, rel=1e-12) for m in branch), (factor, branch[0]["lr"])


@pytest.mark.slow
def test_a_branch_shows_its_own_totals_one_warning_and_applies_no_unchanged_schedule(tmp_path):
    """Issue 37.9, from a checkpoint at factor 2 after 16 steps at factor 1 (step 24, end of epoch 1): the branch's
    first line and progress count to its own last step (24 + 2), not to the 24 its schedule {0: 2, 24: 2} would
    take from epoch 0; the force_resume differences are one warning; --apply of the factor the run already has writes
    nothing; a checkpoint at the cosine's end (LR 0) is refused before any branch starts."""
    cfg = tmp_path / "grow.yaml"
    cfg.write_text(CONFIG.format(out=tmp_path / "grow").replace("{0: 1}}", "{0: 1, 1: 2}}").replace(
        "distributed:", "lr_scheduler: {name: cosine}\ndistributed:"))
    accum("run", str(cfg))
    checkpoints = tmp_path / "grow" / "checkpoints"
    probe = accum("cbs", str(cfg), "--from", str(checkpoints / "step-00000024"), "--factors", "2", "--samples", "64",
                  "--apply")
    assert "2 steps from step 24 (steps 25-26, 64 samples)" in probe.stdout, probe.stdout
    assert "26 optimizer steps, schedule" in probe.stdout and "step 26/26 " in probe.stdout, probe.stdout
    said = (probe.stdout + probe.stderr).splitlines()
    assert len([line for line in said if "checkpoint.force_resume" in line]) == 1, probe.stderr
    assert "nothing to apply" in probe.stdout
    assert not (tmp_path / "grow" / "cbs" / "schedule.yaml").exists()
    assert len(lines(tmp_path / "grow" / "cbs" / "factor-2")) == 2
    low = accum("cbs", str(cfg), "--from", str(checkpoints / "step-00000032"), "--factors", "1,2", "--samples", "8",
                "--out", str(tmp_path / "low"), expect=2)
    assert low.stderr.startswith("error: --from:") and "--allow-low-lr" in low.stderr, low.stderr
    assert len(low.stderr.strip().splitlines()) == 1 and not (tmp_path / "low").exists()


def test_the_plot_has_no_axis_offset_for_tiny_differences():
    """Losses 1e-7 apart: the plot shows each factor's gap to the best in percent with plain tick labels, not
    an offset such as ``1e-7 + 1.177e-1`` that makes a nothing look large (issue 37.9)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from launcher.cli import cbs

    report = {"samples": 128, "step": 432, "tolerance": 0.01, "critical_factor": 8,
              "branches": [{"factor": f, "loss": 0.1177 + d} for f, d in ((1, 0.0), (2, 1e-7), (4, 2e-7), (8, 1e-7))]}
    fig = cbs.figure(report, plt)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.yaxis.get_major_formatter().get_offset() == ""
    assert max(ax.get_lines()[0].get_ydata()) == pytest.approx(100 * 2e-7 / 0.1177)
    assert ax.get_ylim()[1] >= 1.0  # the 1% tolerance is on the axis, so the gaps read as the nothing they are
    plt.close(fig)
