"""Committed checkpoints of an earlier demo run, for the tests of what `accum-sched slurm` (and run) do with an old
run directory. No torch: each checkpoint is committed by launcher.checkpoint.store with a placeholder state file,
which is all a submission reads (manifest, checksums, config hash, world size)."""
from __future__ import annotations

import os
from pathlib import Path

import paths
from launcher.checkpoint import store
from launcher.config import load_config

DEMO = paths.ROOT_PATH / "configs" / "demo.yaml"


def earlier_run(cwd: Path, steps=(10, 20), overrides=()) -> Path:
    """Committed checkpoints of an earlier demo run (2 workers) in cwd/runs/demo/checkpoints; returns that folder."""
    run_dir = cwd / "runs" / "demo"
    cfg = load_config(str(DEMO), [f"run.output_dir={run_dir}", *overrides])
    root = Path(store.checkpoint_root(cfg))
    root.mkdir(parents=True)
    for step in steps:
        tmp = root / f"step-{step:08d}.tmp"
        tmp.mkdir()
        (tmp / store.STATE).write_bytes(os.urandom(64))
        store.commit(str(tmp), store.step_dir(str(root), step),
                     {"format": store.FORMAT, "step": step, "world_size": cfg.world_size, "factor_scale": [1, 1],
                      "config_hash": store.config_hash(cfg), "config": store.training_config(cfg)})
    return root
