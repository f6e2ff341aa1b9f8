"""Issue 37, fault 4 (docs/reliability.md): a dataset that gives a rank no micro-batch (empty, or fewer samples per
rank than one micro-batch under drop_last) is refused in one line naming the sizes, exit 2, before training, with
no model.pt or summary.json. Before: "0 micro-batches", then a TypeError in the trainer (exit 1), and both files
written."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import paths

ROOT = paths.ROOT
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 1}}
task: {{target: {target}, args: {{samples: {samples}}}}}
data: {{micro_batch_size: {micro}, drop_last: true}}
accumulation: {{schedule: {{0: 1}}}}
optimizer: {{name: sgd, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain}}
"""
CASES = {
    "empty": (0, 16, "error: task: the dataset of builtin:regression has 0 samples: nothing to train on; give the "
                     "task samples (e.g. --set task.args.samples=N)"),
    "too-small": (8, 64, "error: data.micro_batch_size: is 64, but the dataset's 8 samples give each of the 2 rank(s) "
                         "4: not one micro-batch per rank with data.drop_last: true; lower data.micro_batch_size to "
                         "at most 4, set data.drop_last: false, or give the task more samples"),
}


def run(tmp_path, target, samples, micro):
    out = tmp_path / "out"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(out=out, target=target, samples=samples, micro=micro))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + paths.TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "launcher", "run", str(cfg)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-4000:]
    assert not (out / "model.pt").exists() and not (out / "summary.json").exists()
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    return done


@pytest.mark.parametrize("case", ["empty", "too-small"])
def test_a_builtin_dataset_without_one_micro_batch_per_rank_is_refused_before_launch(tmp_path, case):
    """builtin:regression: its size is task.args.samples, so the refusal comes before any worker starts."""
    samples, micro, line = CASES[case]
    done = run(tmp_path, "builtin:regression", samples, micro)
    assert done.stderr.strip().splitlines() == [line] and not done.stdout, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["empty", "too-small"])
def test_a_task_dataset_without_one_micro_batch_per_rank_is_refused_by_the_workers(tmp_path, case):
    """Any other task: the workers build it and refuse it before training, rank 0 saying it once for all."""
    samples, micro, line = CASES[case]
    done = run(tmp_path, "faulty_tasks:regression", samples, micro)
    errors = [text for text in done.stderr.splitlines() if text.startswith("error:")]
    assert errors == [line.replace("builtin:regression", "faulty_tasks:regression")], done.stderr[-4000:]
    assert "micro-batches of" not in done.stdout and "TypeError" not in done.stderr
