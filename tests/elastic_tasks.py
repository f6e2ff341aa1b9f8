"""The task of the elastic-run tests (tests/launcher/launch/test_elastic_run.py): faulty_tasks' regression on 288
samples (a global batch of 48 is 6 windows an epoch on 1, 2 or 3 workers, none padded), each micro-batch slowed by
ELASTIC_DELAY_S seconds so that a test can kill or add a node while the run is under way."""
from __future__ import annotations

import os
import time

import faulty_tasks


def regression(samples: int = 288):
    task = faulty_tasks.regression(samples=samples)
    inner, delay = task["loss_fn"], float(os.environ.get("ELASTIC_DELAY_S", "0"))

    def loss_fn(model, batch):
        time.sleep(delay)
        return inner(model, batch)

    return {**task, "loss_fn": loss_fn}
