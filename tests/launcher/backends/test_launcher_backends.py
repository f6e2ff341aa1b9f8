"""The launcher's back-end seam (launcher/backends/) and the worker's written step order.

- the registry's names are the config's ``distributed.backend`` choices, every one a LauncherBackend;
- the config side is torch-free: importing launcher.backends and validating (and preflighting) a DeepSpeed and an
  FSDP2 config imports neither torch nor DeepSpeed;
- no module of launcher/ outside launcher/backends/ compares anything with a back end's name;
- the order after every optimizer step (Trainer._after_step), read from a real 2-rank run of the built-in
  regression with evaluation and a checkpoint at every step and early stopping: the step's metrics.jsonl line,
  then its evaluation (eval.jsonl), then its checkpoint, which already holds that evaluation and, at the early
  stop, is saved as the stop's.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import paths

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)


def test_registry_names_are_the_config_choices():
    from launcher import backends
    from launcher.backends.base import LauncherBackend
    from launcher.config import SCHEMA

    assert backends.names() == SCHEMA["distributed"]["backend"].choices
    assert SCHEMA["distributed"]["backend"].default == backends.names()[0]
    for name in backends.names():
        backend = backends.get(name)
        assert isinstance(backend, LauncherBackend) and backend.name == name


def test_config_side_imports_no_torch():
    probe = """if True:
        import json, sys
        from launcher import backends
        from launcher.checkpoint.store import config_hash
        from launcher.cli.check import preflight
        from launcher.config import load_config
        for path in ("configs/deepspeed.yaml", "configs/fsdp.yaml"):
            cfg = load_config(path)
            preflight(cfg)  # what `accum-sched check` does: the DeepSpeed JSON against the world, too
            config_hash(cfg)  # what preflight's resume check hashes
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed"))))
    """
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def _name_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a comparison has a back end's name as an operand (also inside a tuple, list or set)."""
    def constants(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for item in node.elts:
                yield from constants(item)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(value in names for operand in operands for value in constants(operand)):
                found.append(node.lineno)
        elif isinstance(node, ast.match_case) and any(v in names for v in constants(getattr(node.pattern, "value",
                                                                                                  None))):
            found.append(node.pattern.lineno)
    return found


def test_no_back_end_branch_outside_the_backends():
    from launcher import backends

    names = set(backends.names())
    offenders = []
    for path in sorted(pathlib.Path(ROOT, "launcher").rglob("*.py")):
        if "backends" in path.relative_to(ROOT).parts:
            continue
        for line in _name_comparisons(ast.parse(path.read_text(encoding="utf-8")), names):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert offenders == [], "compare with a back end's name outside launcher/backends/: " + ", ".join(offenders)
    # the check itself sees such a branch
    assert _name_comparisons(ast.parse('if cfg.distributed.backend == "fsdp" or b in ("x", "deepspeed"): pass'),
                             names) == [1, 1]


ORDER = """\
run: {{output_dir: {out}, seed: 0, epochs: 2}}
task: {{target: "step_order_tasks:regression_watching_disk", args: {{run_dir: {out}, samples: 64, val_samples: 20}}}}
data: {{micro_batch_size: 8, shuffle: true}}
accumulation: {{schedule: 2}}
optimizer: {{name: sgd, lr: 0.05}}
lr_scheduler: null
eval: {{every_n_epochs: null, every_n_steps: 1, early_stop: {{patience: 1, min_delta: 1.0e+9}}}}
checkpoint: {{every_n_steps: 1, keep_last: 10}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain, tensorboard: "off"}}
"""


@pytest.mark.slow
def test_after_step_order_metrics_then_eval_then_checkpoint(tmp_path):
    run = tmp_path / "run"
    config = tmp_path / "order.yaml"
    config.write_text(ORDER.format(out=run))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", str(config)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "early stop" in proc.stdout
    # 2 ranks x 32 samples = 4 micro-batches per rank per epoch, factor 2: steps 1, 2 ...; the second evaluation
    # does not improve by 1e9 (patience 1): the run stops after step 2, in epoch 0
    with open(run / "seen-at-eval.jsonl") as f:
        seen = [json.loads(line) for line in f]
    per_eval = [dict(s) for s in {json.dumps(s, sort_keys=True): s for s in seen}.values()]
    assert per_eval == [
        {"metrics": [1], "eval": [], "checkpoints": []},  # step 1: its metrics line first, no checkpoint yet
        {"metrics": [1, 2], "eval": [1], "checkpoints": ["step-00000001"]},
    ], per_eval
    with open(run / "eval.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    root = run / "checkpoints"
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002"]
    for step in (1, 2):  # each checkpoint was written after its step's evaluation
        state = torch.load(root / f"step-{step:08d}" / "trainer.pt", map_location="cpu", weights_only=True)
        assert state["eval"]["last"]["step"] == step
    manifests = [json.loads((root / f"step-{s:08d}" / "manifest.json").read_text()) for s in (1, 2)]
    assert [m["reason"] for m in manifests] == ["step", "stop"]  # the early stop was asked before the save
    assert [(m["backend"], m["sharded"]) for m in manifests] == [("ddp", False)] * 2  # who wrote it, and how
    summary = json.loads((run / "summary.json").read_text())
    assert summary["optimizer_steps"] == 2 and summary["stopped_early"] is True
