"""checkpoint.timeout_s, end to end: a real 2-worker `accum-sched run` (torchrun, gloo) whose rank 0 takes longer
than checkpoint.timeout_s over its first checkpoint commit (tests/slow_commit_tasks.py sleeps inside
launcher.checkpoint.store.commit, as bench/gpu_smoke.py's slow-save worker does).

Rank 1 waits on the coordination group (launcher/checkpoint/coordination.py) and gives up after checkpoint.timeout_s
with an error that names it; rank 0, done committing, finds rank 1 gone and says so, naming the same field. The run
fails (no hang: without the group's own timeout rank 1 would wait for distributed.timeout_s, 600 s)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TESTS = paths.TESTS
ROOT = os.path.dirname(TESTS)
TIMEOUT_S, SLOW_S = 10, 15  # the schema's minimum timeout; rank 0 wakes after rank 1 gave up, well before
# torchrun's 30 s between SIGTERM and SIGKILL of the surviving worker

CONFIG = f"""\
run: {{output_dir: {{out}}, seed: 0, epochs: 2}}
task: {{target: "slow_commit_tasks:regression", args: {{samples: 64}}}}
data: {{micro_batch_size: 8, shuffle: true}}
optimizer: {{name: sgd, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 2, timeout_s: {TIMEOUT_S}}}
logging: {{progress: plain, tensorboard: "off"}}
"""


def test_slow_rank0_commit_fails_every_rank_naming_timeout_s(tmp_path):
    config = tmp_path / "slow.yaml"
    config.write_text(CONFIG.replace("{out}", str(tmp_path / "run")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLOW_COMMIT_", "FAULT_"))}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), SLOW_COMMIT_S=str(SLOW_S))
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", str(config)], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=300)
    took = time.monotonic() - began
    out = proc.stdout[-3000:] + proc.stderr[-8000:]
    assert proc.returncode != 0, out
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    waited = (f"[rank1]: launcher.checkpoint.coordination.CoordinationError: checkpoint committing {step}: rank 1 "
              f"waited longer than checkpoint.timeout_s ({TIMEOUT_S} s) for the other ranks")
    assert waited in proc.stderr, out
    # rank 0 finds rank 1 gone ("lost the other ranks ..."; on a machine so loaded that rank 1 is slow to exit, it
    # may wait out the timeout itself instead): either way its error names the same field
    lost = re.compile(rf"\[rank0\]: launcher\.checkpoint\.coordination\.CoordinationError: checkpoint committing "
                      rf"{re.escape(str(step))}: rank 0 .*checkpoint\.timeout_s \({TIMEOUT_S} s\)")
    assert lost.search(proc.stderr), out
    # rank 1 gave up after TIMEOUT_S, rank 0 after SLOW_S; start-up and teardown on a loaded machine take the rest
    assert took < SLOW_S + 90, f"took {took:.0f} s"
    assert not (tmp_path / "run" / "model.pt").exists()  # the run did not carry on as if nothing happened
