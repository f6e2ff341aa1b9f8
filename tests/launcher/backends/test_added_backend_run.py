"""A back end added from outside the project trains through `accum-sched run`: its two modules
(tests/minimal_backend.py, tests/minimal_launcher_backend.py) and one registry line per side, nothing else.

The two lines run in a ``sitecustomize.py`` put first on PYTHONPATH, so the CLI process and the torchrun worker
both register the back end before launcher.config is imported; no file of accum_sched/ or launcher/ names it. Its
option ``distributed.minimal.lr_multiplier`` multiplies the gradient before SGD steps: the trained model.pt must
equal a plain-torch large-batch reference at LR x the multiplier.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import paths
from cases import launcher_shards
from launcher.tasks.builtin import regression

ROOT = paths.ROOT
LR, MULTIPLIER, SAMPLES, MICRO, EPOCHS = 0.02, 2.5, 100, 16, 3
SCHEDULE = {0: 1, 1: 3}  # 7 micro-batches an epoch: from epoch 1 windows of 3, 3 and a partial 1

CONFIG = f"""\
run: {{output_dir: {{out}}, seed: 0, epochs: {EPOCHS}}}
task: {{target: builtin:regression, args: {{samples: {SAMPLES}}}}}
data: {{micro_batch_size: {MICRO}, shuffle: true}}
accumulation: {{schedule: {SCHEDULE}}}
optimizer: {{name: sgd, lr: {LR}, momentum: 0.9}}
lr_scheduler: null
distributed: {{nproc_per_node: 1}}
logging: {{progress: plain}}
"""

SITECUSTOMIZE = f"""\
import sys
sys.path.insert(0, {str(paths.TESTS_PATH)!r})  # where the two back-end modules live

import minimal_backend
import minimal_launcher_backend
from accum_sched.backends import registry
from launcher import backends

registry.REGISTRY.insert(0, registry.Entry("minimal", minimal_backend.claims, "minimal_backend:MinimalBackend"))
backends._BACKENDS["minimal"] = minimal_launcher_backend.MinimalLauncherBackend()
"""


def run_with_added_backend(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.replace("{out}", str(tmp_path / "run")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), ROOT, os.environ.get("PYTHONPATH", "")])}
    args = [a for s in ("distributed.backend=minimal", *sets) for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "launcher", "run", str(cfg), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def reference(lr: float) -> dict:
    """One process, plain torch: each window is one batch of its micro-batches (the launcher's own shards), SGD."""
    torch.manual_seed(0)
    task = regression(samples=SAMPLES)
    model, data = task["model"], task["dataset"]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(EPOCHS):
        factor = [f for k, f in sorted(SCHEDULE.items()) if k <= epoch][-1]
        (shard,) = launcher_shards(data, 1, MICRO, epoch)
        for start in range(0, len(shard), factor):
            idx = [i for batch in shard[start:start + factor] for i in batch]
            loss = ((model(data.tensors[0][idx]) - data.tensors[1][idx]) ** 2).mean(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.state_dict()


def test_an_added_back_end_with_an_option_trains_like_the_reference(tmp_path):
    proc = run_with_added_backend(tmp_path, f"distributed.minimal.lr_multiplier={MULTIPLIER}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    ref = reference(LR * MULTIPLIER)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-6, rtol=1e-5)
    # the option is what moved the weights: at LR alone they differ (the test can fail)
    plain = reference(LR)
    assert any(not torch.allclose(got[k], plain[k], atol=1e-4) for k in plain)
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "backend: minimal" in config and "lr_multiplier: 2.5" in config


def test_a_bad_option_value_is_one_line_before_launch(tmp_path):
    proc = run_with_added_backend(tmp_path, "distributed.minimal.lr_multiplier=-1")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: distributed.minimal.lr_multiplier: must be > 0, got -1.0; write a number > 0, "
                     "e.g. 2.5"], proc.stderr
    assert not (tmp_path / "run").exists()  # nothing launched, no run directory


def test_the_product_names_no_added_back_end():
    """The back end is added by its modules and the two registry lines only: no file of the product knows it."""
    named = [str(p.relative_to(ROOT)) for package in ("accum_sched", "launcher")
             for p in sorted(Path(ROOT, package).rglob("*")) if p.is_file() and p.suffix in (".py", ".yaml", ".json")
             and "minimal" in p.read_text(errors="replace").lower()]
    assert named == []
    assert "minimal" in Path(paths.TESTS_PATH, "minimal_launcher_backend.py").read_text()  # the grep finds one
