"""accumulation.schedule_from (issue 27.2) through `accum-sched plan` and `accum-sched run`: the LR scheduler's
decay becomes batch growth. The expectations are computed here from the rules' definitions, not from the product:

- a step decay x0.5 at the starts of epochs 1 and 2 (MultiStepLR by import path), epoch unit: smith gives factors
  1, 2, 4 with the LR held at 0.01; seesaw the same factors with the LR x 1/sqrt(2) per halving;
- a cosine decay, step unit, max_factor 4, smith: each step's factor is min(4, floor(1 / cos_multiplier(start))) of
  the micro-batch its window starts at, and its LR is 0.01 x cos_multiplier(start) x factor.
In each, the run's optimizer steps equal the planned total (the LR scheduler is given the exact total) and the
plan printed before launch names that total.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 3}}
task: {{target: "faulty_tasks:regression"}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule_from: {spec}, unit: {unit}}}
optimizer: {{name: sgd, lr: 0.01}}
lr_scheduler: {sched}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain, tensorboard: "off"}}
"""
STEP_DECAY = "{name: torch.optim.lr_scheduler.MultiStepLR, args: {milestones: [16, 32], gamma: 0.5}}"
MICRO = 16  # 256 samples / 2 ranks / 8: micro-batches per rank per epoch; 48 reference steps


def accum(*args, expect=0):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + TESTS + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=300)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run(tmp_path, name, spec, unit="epoch", sched=STEP_DECAY):
    path = tmp_path / f"{name}.yaml"
    path.write_text(CONFIG.format(out=tmp_path / name, spec=spec, unit=unit, sched=sched))
    plan = accum("plan", str(path))
    accum("run", str(path))
    with open(tmp_path / name / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    with open(tmp_path / name / "summary.json") as f:
        summary = json.load(f)
    return plan.stdout, lines, summary


@pytest.mark.parametrize("rule,lrs", [("smith", (0.01, 0.01, 0.01)),
                                      ("seesaw", (0.01, 0.01 / math.sqrt(2), 0.005))])
def test_a_step_decay_becomes_factor_growth(tmp_path, rule, lrs):
    plan, lines, summary = run(tmp_path, rule, f"{{rule: {rule}}}")
    assert [m["factor"] for m in lines] == [1] * 16 + [2] * 8 + [4] * 4
    for m in lines:
        assert m["lr"] == pytest.approx(lrs[{1: 0, 2: 1, 4: 2}[m["factor"]]]), m
    assert summary["optimizer_steps"] == 28
    assert "28 optimizer steps" in plan and "{1: 2, 2: 4}" in plan, plan


def test_a_cosine_becomes_capped_smith_growth_per_step(tmp_path):
    plan, lines, summary = run(tmp_path, "cosine", "{rule: smith, max_factor: 4}", unit="step",
                               sched="{name: cosine}")
    total = 3 * MICRO

    def cosine(s):  # the built-in cosine over the reference run's 48 steps, min_lr 0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))

    start = 0
    for m in lines:
        factor = min(4, max(1, math.floor(1 / cosine(start) + 1e-9)))
        assert m["factor"] == factor, (m, start)
        assert m["lr"] == pytest.approx(0.01 * cosine(start) * factor), (m, start)
        start += m["micro_batches"]
    assert start == total and summary["optimizer_steps"] == len(lines)
    assert {m["factor"] for m in lines} == {1, 2, 3, 4}
    assert f"{len(lines)} optimizer steps" in plan, plan


@pytest.mark.parametrize("spec,extra,field", [
    ("{rule: halve}", "", "accumulation.schedule_from.rule"),
    ("{rule: smith, max_factors: 4}", "", "accumulation.schedule_from.max_factors"),
    ("{rule: smith}", "  schedule: {0: 1}\n", "accumulation.schedule_from"),
])
def test_bad_schedule_from_stops_before_launch(tmp_path, spec, extra, field):
    path = tmp_path / "bad.yaml"
    text = CONFIG.format(out=tmp_path / "bad", spec=spec, unit="epoch", sched=STEP_DECAY)
    if extra:
        text = text.replace("accumulation: {schedule_from", "accumulation: {schedule: {0: 1}, schedule_from")
    path.write_text(text)
    proc = accum("check", str(path), expect=2)
    assert proc.stderr.startswith(f"error: {field}:"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_check_points_to_plan_instead_of_a_placeholder_table(tmp_path):
    """`check` cannot convert without torch (the LR scheduler gives the multipliers): it says so and names `plan`
    instead of printing factor 1 for every epoch and "OK" on that table (issue 37.8). Torch stays unimported."""
    path = tmp_path / "from.yaml"
    path.write_text(CONFIG.format(out=tmp_path / "from", spec="{rule: smith}", unit="epoch", sched=STEP_DECAY))
    probe = ("import sys\nfrom launcher.cli import main\nrc = main(sys.argv[1:])\n"
             "assert not [m for m in sys.modules if m.split('.')[0] == 'torch'], 'check imported torch'\n"
             "sys.exit(rc)")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + TESTS
    proc = subprocess.run([sys.executable, "-c", probe, "check", str(path), "--batches-per-epoch", "16",
                           "--set", "run.epochs=3"], cwd=TESTS, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" not in proc.stdout and "factor" not in proc.stdout, proc.stdout  # no table of guessed factors
    assert "total optimizer steps" not in proc.stdout, proc.stdout
    assert f"accum-sched plan {path} --set run.epochs=3" in proc.stdout, proc.stdout
