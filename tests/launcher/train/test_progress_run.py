"""Progress figures through a real 2-worker `accum-sched run` (issue 28.1): every metrics.jsonl line has samples_per_s,
tokens_per_s (tokens of a token task, null otherwise) and elapsed_s; summary.json has the run's totals, mean
throughput and wall-clock per epoch; the plain progress lines show them with an ETA; the last lines say where the
outputs are and how to see the report; a resumed run's elapsed_s goes on from the line it kept.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)

CHARLM = """\
run: {{output_dir: {out}, seed: 1, epochs: 3}}
task: {{target: builtin:charlm, args: {{max_len: 32, d_model: 32, n_layers: 1}}}}
data: {{micro_batch_size: 8}}
accumulation: {{schedule: {{0: 1, 1: 2, 2: 4}}}}
optimizer: {{name: adamw, lr: 0.003}}
lr_scheduler: null
distributed: {{nproc_per_node: 2}}
logging: {{progress: plain, log_every: 2, tensorboard: "off"}}
"""

FAULTY = """\
run: {{output_dir: {out}, seed: 0, epochs: 3}}
task: {{target: "faulty_tasks:regression", args: {{}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: {{0: 1, 1: 2, 2: 4}}}}
optimizer: {{name: sgd, lr: 0.01}}
lr_scheduler: null
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 4, keep_last: 3}}
logging: {{progress: plain, tensorboard: "off"}}
"""
# faulty_tasks:regression: 256 samples, 2 workers x 8: 16 micro-batches per rank per epoch; steps 16 + 8 + 4 = 28
SPEED = ("samples_per_s", "tokens_per_s", "elapsed_s")


def accum(*args, env_extra=None, expect=0):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + TESTS + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=300)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def outputs(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "summary.json")) as f:
        return lines, json.load(f)


def assert_speed_fields(lines, tokens: bool):
    for m in lines:
        assert set(SPEED) <= set(m), m
        assert m["samples_per_s"] > 0 and m["elapsed_s"] > 0, m
        if tokens:  # tokens are counted over the same steps as samples: more of them (sequences of > 1 token)
            assert m["tokens_per_s"] > m["samples_per_s"], m
        else:
            assert m["tokens_per_s"] is None, m
    elapsed = [m["elapsed_s"] for m in lines]
    assert all(a < b for a, b in zip(elapsed, elapsed[1:])), elapsed


@pytest.fixture(scope="module")
def charlm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("progress")
    cfg = tmp / "charlm.yaml"
    cfg.write_text(CHARLM.format(out=tmp / "run"))
    return str(tmp / "run"), accum("run", str(cfg))


def test_every_metrics_line_and_the_summary_have_the_speed_fields(charlm_run):
    run_dir, _ = charlm_run
    lines, summary = outputs(run_dir)
    assert_speed_fields(lines, tokens=True)
    assert summary["elapsed_s"] >= lines[-1]["elapsed_s"] > 0
    assert summary["samples"] == sum(m["samples"] for m in lines)  # totals kept, under their names
    assert summary["elements"] == sum(m["elements"] for m in lines)
    assert summary["samples_per_s"] == pytest.approx(summary["samples"] / summary["elapsed_s"], rel=1e-3)
    assert summary["tokens_per_s"] == pytest.approx(summary["elements"] / summary["elapsed_s"], rel=1e-3)
    epochs = summary["epoch_seconds"]
    assert len(epochs) == 3 and all(s > 0 for s in epochs)
    assert sum(epochs) == pytest.approx(lines[-1]["elapsed_s"], abs=0.01)  # the epochs' last steps' elapsed_s


def test_progress_lines_show_speed_and_eta_and_the_run_ends_with_where_its_outputs_are(charlm_run):
    run_dir, proc = charlm_run
    shown = [line for line in proc.stdout.splitlines() if " step " in line and line.startswith("epoch ")]
    assert shown, proc.stdout[-3000:]
    pattern = re.compile(r"  [\d.]+[kM]? samples/s  [\d.]+[kM]? tok/s  elapsed \d+:\d\d:\d\d  ETA \d+:\d\d:\d\d$")
    assert all(pattern.search(line) for line in shown), shown
    assert shown[-1].endswith("ETA 0:00:00")  # the last step: nothing left
    tail = proc.stdout.rstrip().splitlines()[-2:]
    run_dir = os.path.abspath(run_dir)
    assert tail == [f"accum-sched: outputs in {run_dir}: metrics.jsonl, summary.json, model.pt",
                    f"accum-sched: see the report: accum-sched report {run_dir}"], proc.stdout[-2000:]
    report = accum("report", run_dir)  # the command it names works
    assert os.path.exists(os.path.join(run_dir, "report.txt")), report.stdout


def test_a_resumed_run_continues_its_elapsed_time(tmp_path):
    cfg, run = tmp_path / "run.yaml", tmp_path / "run"
    cfg.write_text(FAULTY.format(out=run))
    # rank 0's 22nd micro-batch: epoch 1 (factor 2), inside step 19, after the checkpoint at step 16 (epoch 0's end)
    fault = {"FAULT_MODE": "raise", "FAULT_RANK": "0", "FAULT_AT": "22", "FAULT_MARKER": str(tmp_path / "marker")}
    assert accum("run", str(cfg), env_extra=fault, expect=None).returncode != 0
    with open(run / "metrics.jsonl") as f:
        before = [json.loads(line) for line in f]
    resumed = accum("run", str(cfg), "--resume", env_extra=fault)
    assert "resumed from " + str(run / "checkpoints" / "step-00000016") in resumed.stdout + resumed.stderr
    lines, summary = outputs(run)
    assert [m["step"] for m in lines] == list(range(1, 29))
    assert_speed_fields(lines, tokens=False)  # increasing across the resume: it went on, it did not restart
    kept = next(m for m in before if m["step"] == 16)
    assert lines[15]["elapsed_s"] == kept["elapsed_s"] < lines[16]["elapsed_s"]
    assert summary["tokens_per_s"] is None and summary["elapsed_s"] >= lines[-1]["elapsed_s"]
    assert len(summary["epoch_seconds"]) == 3 and all(s > 0 for s in summary["epoch_seconds"])
