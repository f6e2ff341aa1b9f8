"""The suite can fail: with mutant (a) of bench/mutants.py (rank 1 alone divides a partial window's gradient by a
full window's count) the DDP test of tests/accum_sched/test_nonfinite.py, which checks every rank's parameters, fails on
rank 1 (rank 0, checked first, still matches: the run's only partial window is its last, so rank 1's error never
reaches a gradient rank 0 sees). The whole mutation table is bench/mutation.py (docs/testing.md)."""
from __future__ import annotations

import os
import subprocess
import sys

import paths

ROOT = paths.ROOT
sys.path.insert(0, os.path.join(ROOT, "bench"))
import pytest

import mutation

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

TARGET = "tests/accum_sched/test_nonfinite.py::test_nan_on_one_rank_is_skipped_on_every_rank[ddp]"


def test_partial_divisor_on_rank_1_fails_the_every_rank_test(tmp_path):
    env = mutation.mutant_env("a", str(tmp_path))
    assert mutation.probe(env) == "a"  # the engine every interpreter of the run imports is the mutant
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TARGET], cwd=ROOT,
                          env=env, capture_output=True, text=True, check=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]  # tests failed (not a collection or usage error)
    assert "1 failed" in out and "ddp rank 1 param" in out, out[-3000:]
