"""`accum-sched run` refuses GPU settings this machine cannot honour before anything starts (the decisions are
table-tested in test_env.py; here the command's exit status, its one line and that nothing was written)."""
from __future__ import annotations

import subprocess
import sys

import paths

ROOT = paths.ROOT_PATH


def test_nccl_without_cuda_stops_before_launch(tmp_path):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has CUDA: nccl is legitimate here")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "launcher", "run", str(ROOT / "configs" / "demo.yaml"),
                           "--set", f"run.output_dir={out}", "--set", "distributed.process_group=nccl"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: distributed.process_group: is 'nccl' but CUDA is not available")
    assert done.stderr.count("\n") == 1 and not out.exists()  # one line, nothing launched or written
