"""`run.compile` end to end: real `accum-sched run` launches (torch.compile with inductor on CPU, torchrun and gloo for
2 ranks), a schedule that changes factor every epoch ({0: 1, 1: 2, 2: 4}) and partial last windows.

- single process, DDP (2 ranks) and FSDP2 (2 ranks, every Linear a compiled block): model.pt of the compiled run
  equals the plain-torch large-batch reference within 1e-5, with the schedule's exact step and micro-batch counts;
  its keys are the eager model's (compiled in place: no ``_orig_mod.`` prefix); the single-process compiled run also
  equals its eager run;
- summary.json's ``compile_graphs`` / ``compile_recompiles`` are ints when compiled and null when not, and schedule
  changes cost no recompilation: the 3-factor run compiles exactly the shape guard's minimum (one graph at the full
  micro-batch, one recompile at the short one), which is what a constant-factor run compiles;
- DeepSpeed with run.compile is refused before launch: exit 2, one line naming run.compile, no output directory.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from test_launcher_run import accum, reference_regression

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 3, compile: {compile}}}
task: {{target: builtin:regression, args: {{samples: 200}}}}
data: {{micro_batch_size: 16, shuffle: true}}
accumulation: {{schedule: {schedule}}}
optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
lr_scheduler: null
distributed: {distributed}
logging: {{progress: plain}}
"""
SCHEDULE = "{0: 1, 1: 2, 2: 4}"
PIECES = ((0, 1), (1, 2), (2, 4))
DISTRIBUTED = {
    "single": "{backend: ddp, nproc_per_node: 1}",
    "ddp": "{backend: ddp, nproc_per_node: 2}",
    "fsdp": "{backend: fsdp, nproc_per_node: 2, fsdp: {wrap: [Linear]}}",
}
WORLD = {"single": 1, "ddp": 2, "fsdp": 2}
REGIONS = {"single": 1, "ddp": 1, "fsdp": 3}  # compiled forwards: the whole model, or each of the 3 Linear blocks


def write(tmp, name, backend, compile_value="true"):
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(CONFIG.format(out=os.path.join(tmp, name), compile=compile_value, schedule=SCHEDULE,
                              distributed=DISTRIBUTED[backend]))
    return path


def outputs(run_dir):
    model = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    with open(os.path.join(run_dir, "summary.json")) as f:
        return model, json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each back end compiled, and the single-process run eager as well: 4 launches. The compiled runs are held to
    the plain-torch reference (which the eager runs equal: tests/launcher/train/test_launcher_run.py and the back
    ends' own run tests), so an eager twin per back end would prove nothing more."""
    tmp = str(tmp_path_factory.mktemp("compile"))
    out = {}
    for backend, compiled in [(b, True) for b in DISTRIBUTED] + [("single", False)]:
        name = f"{backend}-{'compiled' if compiled else 'eager'}"
        said = accum("run", write(tmp, name, backend, "true" if compiled else "false")).stdout
        out[name] = outputs(os.path.join(tmp, name))
        out[f"{name} stdout"] = said
    return out


@pytest.mark.parametrize("backend", tuple(DISTRIBUTED))
def test_compiled_run_equals_the_large_batch_reference(runs, backend):
    compiled, summary = runs[f"{backend}-compiled"]
    ref = reference_regression(world=WORLD[backend], epochs=3, schedule=PIECES)
    assert list(compiled) == list(ref)  # compiled in place: the eager model's keys, no _orig_mod. prefix
    for key in ref:
        torch.testing.assert_close(compiled[key], ref[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
    assert summary["world_size"] == WORLD[backend]
    # 200 samples an epoch in micro-batches of 16 per rank, factors 1, 2, 4 (partial last windows)
    micro = -(-200 // WORLD[backend] // 16)  # per rank per epoch: 13 on one rank, 7 on two
    assert summary["micro_batches"] == 3 * micro and summary["final_factor"] == 4
    assert summary["optimizer_steps"] == sum(-(-micro // f) for f in (1, 2, 4))
    assert summary["elements"] == 3 * 200


def test_the_eager_run_is_the_same_training(runs):
    compiled, summary = runs["single-compiled"]
    eager, eager_summary = runs["single-eager"]
    assert list(compiled) == list(eager)
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")
    for key in ("optimizer_steps", "micro_batches", "elements", "final_factor"):
        assert summary[key] == eager_summary[key], key
    assert summary["final_loss"] == pytest.approx(eager_summary["final_loss"], abs=1e-5)


@pytest.mark.parametrize("backend", tuple(DISTRIBUTED))
def test_compile_counters_are_ints_compiled(runs, backend):
    _, summary = runs[f"{backend}-compiled"]
    graphs, recompiles = summary["compile_graphs"], summary["compile_recompiles"]
    assert type(graphs) is int and type(recompiles) is int
    # The bound: every compiled forward is compiled once at the full micro-batch (16 samples) and once more when
    # epoch 0's short last micro-batch (8 samples on one rank, 4 on two) fails its shape guard; that recompile
    # marks the batch dimension dynamic, and the dynamic graph serves every later shape. The factor and the
    # window's normalisation live in the engine's loss scaling, outside the compiled forward, so the two factor
    # changes and the partial windows add nothing: a run at one constant factor compiles exactly as often.
    assert recompiles == REGIONS[backend] and graphs == 2 * REGIONS[backend], summary


def test_compile_counters_are_null_eager(runs):
    _, eager = runs["single-eager"]
    assert eager["compile_graphs"] is None and eager["compile_recompiles"] is None


@pytest.mark.parametrize("backend", tuple(DISTRIBUTED))
def test_compilation_is_announced_and_timed(runs, backend):
    """Issue 37.10: a line before the first step's compilation and one after it with its seconds, in that order
    and before the first progress line; nothing of it for an eager run."""
    said = runs[f"{backend}-compiled stdout"].splitlines()
    start = [i for i, line in enumerate(said) if "run.compile: the first step compiles" in line]
    done = [i for i, line in enumerate(said) if re.search(r"run\.compile: compiled in \d+\.\ds \(step 1;", line)]
    first_progress = min(i for i, line in enumerate(said) if re.search(r"step \d+/", line))
    assert len(start) == 1 and len(done) == 1 and start[0] < done[0] < first_progress, said
    assert "run.compile" not in runs["single-eager stdout"]


def test_deepspeed_refuses_compile_before_launch(tmp_path):
    path = write(str(tmp_path), "ds", "single")
    text = open(path).read().replace("{backend: ddp, nproc_per_node: 1}",
                                     "{backend: deepspeed, nproc_per_node: 2, deepspeed_config: "
                                     "{zero_optimization: {stage: 1}}}")
    with open(path, "w") as f:
        f.write(text)
    proc = accum("run", path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: run.compile: ") and "deepspeed" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not os.path.exists(tmp_path / "ds"), "a run directory: something was launched"
