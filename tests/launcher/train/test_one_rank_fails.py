"""One rank fails, the others do not (issue 28.5, docs/reliability.md): an exception on rank 1 only, a NaN loss in
one rank's micro-batch under accumulation.nonfinite: raise. Every rank stops within the test's timeout (no hang)
and `accum-sched run` ends with one line naming the rank that failed first and its error. (nonfinite: skip, the
default, skips the step on every rank instead: tests/launcher/checkpoint/test_checkpoint.py's NaN sample,
tests/accum_sched/test_nonfinite.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TESTS = paths.TESTS
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 2}}
task: {{target: "faulty_tasks:regression", args: {args}}}
data: {{micro_batch_size: 8}}
accumulation: {{schedule: {{0: 2}}, nonfinite: {nonfinite}}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain}}
"""


def run(tmp_path, args="{}", nonfinite="skip", fault=None):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(out=tmp_path / "run", args=args, nonfinite=nonfinite))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
    env["PYTHONPATH"] = paths.ROOT + os.pathsep + TESTS
    env.update(fault or {})
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", str(cfg)], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=300)  # a hang fails here
    assert proc.returncode != 0
    return proc.stderr.strip().splitlines()[-1], str(cfg)


def test_an_exception_on_one_rank_stops_every_rank_naming_it(tmp_path):
    fault = {"FAULT_MODE": "raise", "FAULT_RANK": "1", "FAULT_AT": "5", "FAULT_MARKER": str(tmp_path / "marker")}
    last, cfg = run(tmp_path, fault=fault)
    assert last == (f"error: rank 1 failed first: RuntimeError: faulty_tasks: injected failure at micro-batch 5; "
                    f"every rank stopped (tracebacks above): fix the cause, then `accum-sched run {cfg} --resume` "
                    "continues from the last checkpoint")
    assert sorted(os.listdir(tmp_path / "run" / ".failures")) == ["rank-0.json", "rank-1.json"]  # both stopped


def test_a_nan_on_one_rank_under_nonfinite_raise_stops_every_rank_naming_the_step(tmp_path):
    last, _ = run(tmp_path, args="{nan_index: 37}", nonfinite="raise")  # sample 37: one rank's micro-batch
    assert last.startswith("error: rank ") and " failed first: FloatingPointError: non-finite loss or gradient at " \
        "epoch 0, step 8 (nonfinite='raise'; use nonfinite='skip' to skip such steps); every rank stopped" in last, last
    assert sorted(os.listdir(tmp_path / "run" / ".failures")) == ["rank-0.json", "rank-1.json"]
