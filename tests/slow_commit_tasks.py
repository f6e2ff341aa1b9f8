"""User task (``slow_commit_tasks:regression``) for tests/launcher/checkpoint/test_checkpoint_timeout.py:
faulty_tasks' regression, with rank 0 taking longer than it should over its first checkpoint commit.

Building the task replaces ``launcher.checkpoint.store.commit`` in this worker with one that first sleeps (a
stand-in for hashing and fsyncing a large checkpoint), as bench/gpu_smoke.py's slow-save worker does. Set by
environment variables, not task.args (those are part of the config hash):

  SLOW_COMMIT_S     seconds the first commit sleeps (0 or unset: no delay)
  SLOW_COMMIT_RANK  the rank that is slow (RANK of torchrun; default 0, the only rank that commits)
"""
from __future__ import annotations

import os
import time

from faulty_tasks import regression as _regression


def regression(**args):
    delay = float(os.environ.get("SLOW_COMMIT_S", "0"))
    if delay > 0 and os.environ.get("RANK", "0") == os.environ.get("SLOW_COMMIT_RANK", "0"):
        from launcher.checkpoint import store

        commit, slept = store.commit, []

        def slow_commit(*a, **kw):
            if not slept:
                slept.append(True)
                time.sleep(delay)
            return commit(*a, **kw)

        store.commit = slow_commit
    return _regression(**args)
