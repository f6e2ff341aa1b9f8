"""Validation end to end: real `accum-sched run` launches (torchrun, gloo) of tests/eval_tasks.py.

- 2 ranks, dropout, evaluations at epoch ends and every 5 steps: eval.jsonl's val_loss and metrics are the plain means
  over the odd-sized validation set (computed here from model.pt / model-best.pt), each sample counted once; the
  run ends with model.pt bit for bit equal to the same run without a validation set; `report` shows them.
- 3 ranks (shards of 34, 34 and 33 samples, so one rank runs a filler forward), RMSprop and StepLR by import path,
  early stopping: every rank stops after the same epoch, model.pt equals a plain-torch large-batch reference, and a
  resume of the stopped run keeps the early-stop state (it trains nothing more).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import paths

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)
import eval_tasks  # noqa: E402
from cases import launcher_shards  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TWO_RANKS = """\
run: {{output_dir: {out}, seed: 0, epochs: 3}}
task: {{target: "eval_tasks:regression", args: {{dropout: 0.2, with_val: {with_val}}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: {{0: 1, 1: 2}}}}
optimizer: {{name: adamw, lr: 0.01}}
lr_scheduler: {{name: cosine, warmup_steps: 2}}
eval: {{every_n_epochs: 1, every_n_steps: 5, micro_batch_size: 7}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain, tensorboard: "off"}}
"""
THREE_RANKS = """\
run: {{output_dir: {out}, seed: 0, epochs: 5}}
task: {{target: "eval_tasks:regression", args: {{}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: {{0: 1, 1: 2}}}}
optimizer: {{name: torch.optim.RMSprop, lr: 0.01, momentum: 0.5, weight_decay: 0.01, no_decay: [bias],
             args: {{alpha: 0.95, centered: true}}}}
lr_scheduler: {{name: "torch.optim.lr_scheduler:StepLR", args: {{step_size: 2, gamma: 0.5}}}}
eval: {{micro_batch_size: 11, early_stop: {{patience: 1, min_delta: 1.0e+9}}}}
distributed: {{backend: ddp, nproc_per_node: 3}}
logging: {{progress: plain, tensorboard: "off"}}
"""


def accum(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def launch(tmp, name, template, **fields):
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(template.format(out=os.path.join(tmp, name), **fields))
    return path, os.path.join(tmp, name), accum("run", path)


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def load(run, name="model.pt"):
    return torch.load(os.path.join(run, name), weights_only=True)


def check_exact(record, state, tag, dropout=0.0):
    """eval.jsonl numbers against the test's plain means over the whole validation set."""
    plain = eval_tasks.plain_eval(state, dropout)
    assert record["val_elements"] == 101, (tag, record)
    for key in ("val_loss", "mae", "sign_acc"):
        assert record[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-9), (tag, key, record, plain)


def test_validation_is_exact_and_does_not_touch_training(tmp_path):
    _, run, proc = launch(str(tmp_path), "with", TWO_RANKS, with_val="true")
    _, bare, _ = launch(str(tmp_path), "without", TWO_RANKS, with_val="false")

    evals, steps = lines(os.path.join(run, "eval.jsonl")), lines(os.path.join(run, "metrics.jsonl"))
    # 48 samples per rank = 6 micro-batches: steps 6 + 3 + 3; every 5 steps (5, 10) and at epoch ends (6, 9, 12)
    assert [(e["epoch"], e["step"]) for e in evals] == [(0, 5), (0, 6), (1, 9), (2, 10), (2, 12)]
    epoch_of = {s["step"]: s["epoch"] for s in steps}
    assert all(e["epoch"] == epoch_of[e["step"]] for e in evals)  # one (0-based) epoch numbering in both files
    check_exact(evals[-1], load(run), "last", 0.2)
    summary = json.load(open(os.path.join(run, "summary.json")))
    best = min(evals, key=lambda e: e["val_loss"])
    assert summary["last_eval"] == evals[-1] and summary["best_eval"] == best
    check_exact(best, load(run, "model-best.pt"), "best", 0.2)
    assert "eval  epoch 2  step 12  val_loss" in proc.stdout and "epoch 2 of 0-2 done" in proc.stdout
    # the report: validation curve next to the training one, last and best in the text
    text = accum("report", run).stdout
    assert f"validation        val_loss {evals[-1]['val_loss']:.6g} at step 12 (epoch 2), 101 elements" in text
    assert f"best validation   val_loss {best['val_loss']:.6g} (min) at step {best['step']}" in text
    assert os.path.getsize(os.path.join(run, "report.png")) > 10_000

    # evaluation changed nothing in training (dropout, the RNG, modes): same bits, same losses
    with_val, without = load(run), load(bare)
    assert all(torch.equal(with_val[k], without[k]) for k in without), "evaluation perturbed training"
    assert [s["loss"] for s in steps] == [s["loss"] for s in lines(os.path.join(bare, "metrics.jsonl"))]
    assert not os.path.exists(os.path.join(bare, "eval.jsonl"))


def reference_three_ranks(epochs=2, world=3, micro=8):
    """Plain torch, one process: RMSprop with biases out of weight decay, StepLR, one big batch per window."""
    torch.manual_seed(0)
    task = eval_tasks.regression()
    model, data = task["model"], task["dataset"]
    weights = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.RMSprop([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.01,
                              momentum=0.5, weight_decay=0.01, alpha=0.95, centered=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for epoch in range(epochs):
        factor = 1 if epoch == 0 else 2
        shards = launcher_shards(data, world, micro, epoch)
        for start in range(0, len(shards[0]), factor):
            idx = [i for r in range(world) for b in shards[r][start:start + factor] for i in b]
            x, y = data.tensors[0][idx], data.tensors[1][idx]
            loss = eval_tasks.per_sample_loss(model, x, y).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.state_dict()


def test_early_stop_on_three_ranks_with_optimizer_by_import_path(tmp_path):
    path, run, proc = launch(str(tmp_path), "stop", THREE_RANKS)
    evals, steps = lines(os.path.join(run, "eval.jsonl")), lines(os.path.join(run, "metrics.jsonl"))
    # nothing improves by 1e9: the first evaluation is the best, the second exhausts patience 1, on every rank
    assert [e["epoch"] for e in evals] == [0, 1]
    assert {s["epoch"] for s in steps} == {0, 1} and len(steps) == 4 + 2  # 32 samples per rank = 4 micro-batches
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["stopped_early"] and summary["completed_epochs"] == 2 and summary["best_eval"] == evals[0]
    assert "early stop" in proc.stdout
    check_exact(evals[1], load(run), "last, 3 ranks")
    check_exact(evals[0], load(run, "model-best.pt"), "best, 3 ranks")

    got, ref = load(run), reference_three_ranks()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-6, msg=f"RMSprop by import path: {key}")

    # resume: the checkpoint holds the early-stop state, so the stopped run trains nothing more
    again = accum("run", path, "--resume")
    assert len(lines(os.path.join(run, "metrics.jsonl"))) == len(steps)
    assert lines(os.path.join(run, "eval.jsonl")) == evals
    assert json.load(open(os.path.join(run, "summary.json")))["stopped_early"]
    assert all(torch.equal(load(run)[k], got[k]) for k in got), again.stdout


def test_report_reads_eval_lines():
    from launcher.report import render as report

    text = ['{"epoch": 0, "step": 4, "val_loss": 0.5}', '{"epoch": 1, "step": 8, "val_loss": 0.3}',
            '{"epoch": 1, "step": 6, "val_loss": 0.4}', '{"epoch": 2, "step": 9, "val_lo']  # rewound, torn
    evals = report.parse_evals(text)
    assert [e["step"] for e in evals] == [4, 6]
    assert report.best_eval(evals)["step"] == 6 and report.best_eval(evals, mode="max")["step"] == 4
