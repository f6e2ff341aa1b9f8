"""The README's own-loop example runs as documented (torchrun, 2 workers) and follows its schedule."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_own_loop_example_runs():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "examples/own_loop.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch")]
    # 1000 samples / 2 ranks / 16 = 32 micro-batches per epoch: factor 1, 1, 2, 2, 4, 4
    steps = [int(line.split("steps ")[1].split(",")[0]) for line in lines]
    assert steps == [32, 64, 80, 96, 104, 112]
    assert [line.split("factor ")[1].split(",")[0] for line in lines] == ["1", "1", "2", "2", "4", "4"]
