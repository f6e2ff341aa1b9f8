"""A task for tests/launcher/backends/test_launcher_backends.py: the built-in regression with a validation set whose
loss function, on rank 0, writes down what is on disk when an evaluation runs (metrics.jsonl and eval.jsonl steps,
checkpoints), so the test can read the order of the worker's after-step work from a real run."""
from __future__ import annotations

import json
import os

from launcher.tasks.builtin import regression


def _steps(path: str) -> list[int]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def regression_watching_disk(run_dir: str, **kwargs):
    task = regression(**kwargs)
    train_loss = task["loss_fn"]
    record = os.path.join(run_dir, "seen-at-eval.jsonl")

    def val_loss_fn(model, batch):
        if os.environ.get("RANK", "0") == "0":
            root = os.path.join(run_dir, "checkpoints")
            seen = {"metrics": _steps(os.path.join(run_dir, "metrics.jsonl")),
                    "eval": _steps(os.path.join(run_dir, "eval.jsonl")),
                    "checkpoints": sorted(n for n in os.listdir(root) if n.startswith("step-")
                                          and not n.endswith(".tmp")) if os.path.isdir(root) else []}
            with open(record, "a", encoding="utf-8") as f:
                f.write(json.dumps(seen) + "\n")
        return train_loss(model, batch)

    task["val_loss_fn"] = val_loss_fn
    return task
