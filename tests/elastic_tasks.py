"""The task of the elastic-run tests (tests/launcher/launch/test_elastic_run.py): faulty_tasks' regression on 288
samples (a global batch of 48 is 6 windows an epoch on 1, 2 or 3 workers, none padded), each micro-batch slowed by
ELASTIC_DELAY_S seconds while the group holds 2 workers, so that a test can kill or add a node while the run is
under way (every elastic test acts on a group of 2); a group re-formed at another size trains at full speed."""
from __future__ import annotations

import os
import time

import faulty_tasks


def regression(samples: int = 288):
    task = faulty_tasks.regression(samples=samples)
    delay = float(os.environ.get("ELASTIC_DELAY_S", "0")) if os.environ.get("WORLD_SIZE") == "2" else 0.0
    inner = task["loss_fn"]

    def loss_fn(model, batch):
        time.sleep(delay)
        return inner(model, batch)

    return {**task, "loss_fn": loss_fn}
