"""User task (``slow_write_tasks:regression``) for tests/launcher/checkpoint/test_checkpoint_async.py: faulty_tasks'
regression whose rank 0 sleeps before it writes each trainer.pt (a stand-in for serialising a large model), so
that under checkpoint.async training goes on, changing parameters and optimizer state, while the checkpoint of an
earlier step is written. Set by environment variables, not task.args (those are part of the config hash):

  SLOW_WRITE_S  seconds rank 0 sleeps before writing each trainer.pt (0 or unset: no delay)
"""
from __future__ import annotations

import os
import time

from faulty_tasks import regression as _regression


def regression(**args):
    delay = float(os.environ.get("SLOW_WRITE_S", "0"))
    if delay > 0 and os.environ.get("RANK", "0") == "0":
        from launcher.checkpoint import store

        opened = store.HashingFile.__init__

        def slow_open(self, path, *a, **kw):
            if os.path.basename(path) == store.STATE:
                time.sleep(delay)
            opened(self, path, *a, **kw)

        store.HashingFile.__init__ = slow_open
    return _regression(**args)
