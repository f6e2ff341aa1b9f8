"""accumulation.co_scale through `accum-sched run` (issue 27.1): every metrics.jsonl line carries the lr, beta2 and
weight_decay its step ran with, following the factor; a run that crashes after a factor change and resumes from a
checkpoint taken before it ends bit for bit where the uninterrupted run ends; rules that cannot apply stop before
launch (exit 2, one line naming the key).

The expected values are computed here from the rules' definitions: r = factor / first factor; AdamW with
co_scale {lr: auto (= sqrt), beta2: half_life, weight_decay: tau}: lr 0.01 x sqrt(r), beta2 0.999 ** r,
weight decay 0.05 x r / sqrt(r).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)

CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 3}}
task: {{target: "faulty_tasks:regression", args: {{dropout: 0.1}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: {{0: 1, 1: 2, 2: 4}}, co_scale: {co_scale}}}
optimizer: {{name: {optimizer}, lr: 0.01, weight_decay: 0.05}}
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 4, keep_last: 3}}
logging: {{progress: plain, tensorboard: "off"}}
"""
RULES = "{lr: auto, beta2: half_life, weight_decay: tau}"
# 256 samples, 2 workers x 8: 16 micro-batches per rank per epoch; steps 16 + 8 + 4 = 28


def write(tmp, name, co_scale=RULES, optimizer="adamw"):
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(CONFIG.format(out=os.path.join(tmp, name), co_scale=co_scale, optimizer=optimizer))
    return path


def accum(*args, env_extra=None, expect=0):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + TESTS + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=300)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("co_scale_ref")
    accum("run", write(tmp, "ref"))
    return os.path.join(tmp, "ref")


def test_each_metrics_line_carries_the_co_scaled_values(ref):
    lines = metrics(ref)
    assert [m["factor"] for m in lines] == [1] * 16 + [2] * 8 + [4] * 4
    for m in lines:
        r = m["factor"]
        assert m["lr"] == pytest.approx(0.01 * math.sqrt(r)), m
        assert m["beta2"] == pytest.approx(0.999 ** r), m
        assert m["weight_decay"] == pytest.approx(0.05 * r / math.sqrt(r)), m


def test_resume_across_a_factor_change_is_bitwise(ref, tmp_path):
    cfg, run = write(tmp_path, "run"), os.path.join(tmp_path, "run")
    # rank 0's 38th micro-batch: epoch 2 (factor 4), after the checkpoints at steps 16 (end of epoch 0, factor 1),
    # 20 and 24 (end of epoch 1, factor 2): the resume crosses the change from 2 to 4 again
    fault = {"FAULT_MODE": "raise", "FAULT_RANK": "0", "FAULT_AT": "38", "FAULT_MARKER": str(tmp_path / "marker")}
    crashed = accum("run", cfg, env_extra=fault, expect=None)
    assert crashed.returncode != 0
    names = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert names[-1] == "step-00000024", names
    os.remove(os.path.join(run, "checkpoints", "step-00000024", "trainer.pt"))  # force the older one, factor 2
    resumed = accum("run", cfg, "--resume", env_extra=fault)
    assert "resumed from " + os.path.join(run, "checkpoints", "step-00000020") in resumed.stdout + resumed.stderr
    got, want = torch.load(os.path.join(run, "model.pt")), torch.load(os.path.join(ref, "model.pt"))
    for k in want:
        assert torch.equal(got[k], want[k]), k
    strip = [{k: v for k, v in m.items() if k not in ("wall_time", "elapsed_s", "samples_per_s", "tokens_per_s")}
             for m in metrics(run)]
    assert strip == [{k: v for k, v in m.items() if k not in ("wall_time", "elapsed_s", "samples_per_s",
                                                                 "tokens_per_s")} for m in metrics(ref)]


@pytest.mark.parametrize("co_scale,optimizer,field", [
    ("{beta2: half_life}", "sgd", "accumulation.co_scale.beta2"),
    ("{lr: cubic}", "adamw", "accumulation.co_scale.lr"),
    ("{beta3: none}", "adamw", "accumulation.co_scale.beta3"),
    ("[sqrt]", "adamw", "accumulation.co_scale"),
])
def test_rules_that_cannot_apply_stop_before_launch(tmp_path, co_scale, optimizer, field):
    proc = accum("check", write(tmp_path, "bad", co_scale=co_scale, optimizer=optimizer), expect=2)
    assert proc.stderr.startswith(f"error: {field}:"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
