"""`accum-sched run` with FSDP2 on a 2 x 2 mesh (HSDP: `distributed.fsdp.mesh: [2, 2]`, 4 gloo workers).

- `gradient_sync: reduce_scatter`, and `keep_gathered: true` (boundary sync), each end at the plain-torch large-batch
  reference (a schedule 1 -> 3 -> 2 whose factor-3 epoch ends in a partial window), the epoch-end checkpoint's
  DCP metadata showing 2 shards per parameter (the mesh was applied, not a 1-D mesh of 4);
- a mesh that is not two positive integers, or whose product is not the world size, is one line naming the field,
  exit 2, before anything is launched (`check` imports no torch).

Few and small on purpose: 4 ranks on a 2-core machine are slow. The per-micro-batch collectives of every mode are
counted in tests/accum_sched/test_fsdp_hsdp.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import paths

sys.path.insert(0, os.path.join(paths.TESTS, "launcher", "checkpoint"))
from test_checkpoint import CONFIG, accum, checkpoints, outputs, reference_large_batch  # noqa: E402

ROOT = paths.ROOT
# 256 samples, 4 workers x 8: 8 micro-batches per rank and epoch; steps 8 + 3 (3, 3, 2: partial) + 4 = 15
SCHEDULE = (1, 3, 2)


def write_config(tmp, name, fsdp):
    text = CONFIG.format(out=os.path.join(tmp, name), args="{}", lr_scheduler="null")
    text = text.replace("{0: 1, 1: 2, 2: 3}", "{0: 1, 1: 3, 2: 2}").replace("checkpoint: {every_n_steps: 4, ",
                                                                            "checkpoint: {")
    text = text.replace("distributed: {backend: ddp, nproc_per_node: 2}",
                        f"distributed: {{backend: fsdp, nproc_per_node: 4, fsdp: {fsdp}}}")
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


RUNS = {"reduce_scatter": "{mesh: [2, 2], gradient_sync: reduce_scatter, wrap: [Linear]}",
        "keep_gathered": "{mesh: [2, 2], keep_gathered: true, wrap: [Linear]}"}


@pytest.mark.parametrize("name", list(RUNS))
@pytest.mark.slow
def test_hsdp_run_equals_large_batch_reference(tmp_path, name):
    accum("run", write_config(tmp_path, name, RUNS[name]))
    run = os.path.join(tmp_path, name)
    model, metrics, summary = outputs(run)
    want = reference_large_batch(world=4, schedule=SCHEDULE)
    assert list(model) == list(want)
    for key in want:
        torch.testing.assert_close(model[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert [m["factor"] for m in metrics] == [1] * 8 + [3] * 3 + [2] * 4
    assert summary["world_size"] == 4 and summary["optimizer_steps"] == 15 and summary["micro_batches"] == 24
    # reduce-scatter rounds per rank: every micro-batch, or only the 15 boundaries
    assert summary["allreduce_rounds"] == (24 if name == "reduce_scatter" else 15)
    dcp = os.path.join(run, "checkpoints", checkpoints(run)[-1], "fsdp")
    assert len([s for s in os.listdir(dcp) if s.endswith(".distcp")]) == 4
    # the mesh really is 2 x 2: the 32 x 8 weight is in 2 shards of 16 rows (a 1-D mesh would make 4 of 8)
    chunks = FileSystemReader(dcp).read_metadata().state_dict_metadata["model.0.weight"].chunks
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [((0, 0), (16, 8)), ((16, 0), (16, 8))]


BAD = [
    ("distributed.fsdp.mesh=[2,3]", "2 x 3 ranks but the world has 4"),
    ("distributed.fsdp.mesh=[4]", "expected null or two positive integers [replicas, shards], got [4]"),
    ("distributed.fsdp.mesh=[0,4]", "expected null or two positive integers"),
    ("distributed.fsdp.mesh=4", "expected a list, got 4; write e.g. [2, 4], or null"),
]


def test_bad_mesh_is_one_line_exit_2_before_launch(tmp_path):
    cfg = write_config(tmp_path, "cfg", RUNS["reduce_scatter"])
    probe = ("import sys; from launcher.cli import main; code = main(['check', *sys.argv[1:]]); "
             "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for override, words in BAD:
        proc = subprocess.run([sys.executable, "-c", probe, cfg, "--set", override], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (override, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("error: distributed.fsdp.mesh: ") and words in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # run: the same line, and no worker started (no run directory)
    proc = accum("run", cfg, "--nproc-per-node", "2", expect=2)
    assert proc.stderr.strip() == ("error: distributed.fsdp.mesh: 2 x 2 ranks but the world has 2 (nnodes x "
                                   "nproc_per_node); make replicas x shards equal the world size, or null")
    assert not os.path.exists(os.path.join(tmp_path, "cfg"))
