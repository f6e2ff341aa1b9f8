"""A task for the SLURM tests: the built-in regression (the demo's model and data, unchanged), built after writing
the launch variables this worker process sees into `record_dir` (one JSON per rank and restart). The task is built
after the worker exported its detected launch, right where DeepSpeed would start, so the record shows what
DeepSpeed and torch read there."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from launcher.tasks.builtin import regression

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
         "SLURM_LOCALID", "SLURM_NODEID")


def regression_recording_env(record_dir: str, **kwargs):
    record = {name: os.environ.get(name) for name in NAMES}
    record.update(host=socket.gethostname(), restart=os.environ.get("SLURM_RESTART_COUNT", "0"))
    folder = Path(record_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"env-{record['RANK']}-{record['restart']}.json").write_text(json.dumps(record))
    return regression(**kwargs)
