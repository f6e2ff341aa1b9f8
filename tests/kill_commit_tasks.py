"""User task (``kill_commit_tasks:regression``) for tests/launcher/checkpoint/test_checkpoint_hostile.py:
faulty_tasks' regression whose rank 0 stops inside its K-th checkpoint commit (every file of ``step-N.tmp``
written, the manifest and the rename not yet) and waits there, so that the test can SIGKILL the whole run at that
point. Set by environment variables, not task.args (those are part of the config hash):

  KILL_COMMIT_AT      K (0 or unset: never stop)
  KILL_COMMIT_MARKER  a file created (holding the .tmp path) when rank 0 starts waiting
"""
from __future__ import annotations

import os
import time

from faulty_tasks import regression as _regression


def regression(**args):
    at = int(os.environ.get("KILL_COMMIT_AT", "0") or 0)
    if at and os.environ.get("RANK", "0") == "0":
        from launcher.checkpoint import store

        commit, count = store.commit, [0]

        def waiting_commit(tmp, final, *a, **kw):
            count[0] += 1
            if count[0] == at:
                with open(os.environ["KILL_COMMIT_MARKER"], "w") as f:
                    f.write(tmp)
                time.sleep(600)
            return commit(tmp, final, *a, **kw)

        store.commit = waiting_commit
    return _regression(**args)
