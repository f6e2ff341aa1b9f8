"""Issue 37, faults 2, 3, 6 and 7 (docs/reliability.md): a resume that fails moves nothing, `--resume auto` passes
over a checkpoint that fails to load, a resume from an older checkpoint keeps the metrics it rewinds and says what
is missing, every load path gives a planted or foreign pickle the same one line and exit 2, and force_resume
onto another optimizer drops the old optimizer's state with a line saying so."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

import paths
from launcher import cli
from launcher.checkpoint import store

ROOT, TESTS = paths.ROOT, paths.TESTS
# 2 ranks x 8 micro-batches of 16 per epoch at factor 1: 8 steps an epoch, 16 in all; checkpoints at 3, 6, 8 (epoch
# end), 9, 12, 15, 16
DDP = """\
run: {{output_dir: {out}, seed: 0, epochs: 2}}
task: {{target: builtin:regression, args: {{samples: 256}}}}
data: {{micro_batch_size: 16}}
accumulation: {{schedule: {{0: 1}}}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 3, keep_last: 20}}
logging: {{progress: none}}
"""
# a stream (stream_tasks:numbers, endless) ended by max_steps: every checkpoint is inside its epoch, so each rank
# writes stream-rank<R>.pt, read by that rank only
STREAM = """\
run: {{output_dir: {out}, seed: 0, max_steps: 8}}
task: {{target: stream_tasks:numbers, args: {{}}}}
data: {{micro_batch_size: 3}}
accumulation: {{schedule: {{0: 1}}}}
optimizer: {{name: sgd, lr: 0.1}}
lr_scheduler: null
distributed: {{nproc_per_node: 2}}
checkpoint: {{every_n_steps: 2, keep_last: 20}}
logging: {{progress: none}}
"""
PAYLOAD_LINE = ("{file}: cannot be loaded (it would import os.makedirs, refused by weights_only); nothing of it was "
                "run: resume from an earlier checkpoint (--resume PATH), or start afresh without --resume")


class Payload:
    """Unpickled, it creates the directory ``marker``: proof that a pickle ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def accum(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT_", "RECORD_DIR"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + TESTS + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=timeout)


def plant(checkpoint: str, rel: str, write) -> str:
    """Replace ``rel`` of ``checkpoint`` by what ``write(path)`` writes and rewrite the manifest to match (so the
    checksums cannot tell)."""
    path = os.path.join(checkpoint, rel)
    write(path)
    with open(os.path.join(checkpoint, store.MANIFEST)) as f:
        manifest = json.load(f)
    with open(path, "rb") as f:
        data = f.read()
    manifest["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(checkpoint, store.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return path


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def tree(folder) -> list[str]:
    return sorted(os.listdir(folder))


def steps_of(run_dir) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.fixture(scope="module")
def finished_ddp_run(tmp_path_factory):
    """A finished 2-rank DDP run (adamw) with checkpoints at steps 3, 6, 8, 9, 12, 15 and 16; tests copy it."""
    base = tmp_path_factory.mktemp("ddp")
    cfg = base / "cfg.yaml"
    cfg.write_text(DDP.format(out=base / "run"))
    done = accum("run", str(cfg))
    assert done.returncode == 0, done.stderr[-4000:]
    return base


def copy_run(finished, tmp_path):
    """The finished run under ``tmp_path`` (its config pointing there): (config path, run directory)."""
    run = tmp_path / "run"
    shutil.copytree(finished / "run", run, ignore=shutil.ignore_patterns(".accum-sched*.lock"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(DDP.format(out=run))
    return str(cfg), run


@pytest.mark.slow
def test_a_failed_resume_moves_nothing_and_auto_passes_over_a_checkpoint_that_fails_to_load(tmp_path):
    """The issue's probe: a finished stream run, a pickle planted in step-4's stream-rank1.pt (read only by rank 1;
    manifest rewritten), `--resume .../step-00000004`. Before: the newer checkpoints were renamed `.abandoned`
    before rank 1 failed, and `--resume auto` picked the broken one again. Now the plant is refused in one line,
    exit 2, nothing moved; and a checkpoint whose state file passes every check but fails to load on rank 1 (the
    newest, step 8) is skipped by `--resume auto`, naming it, for the newest one that loads (step 6)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(STREAM.format(out=tmp_path / "run"))
    first = accum("run", str(cfg))
    assert first.returncode == 0, first.stderr[-4000:]
    root = tmp_path / "run" / "checkpoints"
    finished = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    names = tree(root)
    assert names == [f"step-0000000{s}" for s in (2, 4, 6, 8)], names
    marker = str(tmp_path / "ran")
    planted = plant(str(root / "step-00000004"), "stream-rank1.pt",
                    lambda p: torch.save({"format": store.FORMAT, "stream": Payload(marker)}, p))
    before = {name: tree(root / name) for name in names}
    refused = accum("run", str(cfg), "--resume", str(root / "step-00000004"))
    assert refused.returncode == 2, refused.stderr[-4000:]
    assert refused.stderr.strip().splitlines() == ["error: " + PAYLOAD_LINE.format(file=planted)], refused.stderr
    assert {name: tree(root / name) for name in tree(root)} == before  # nothing moved, renamed or deleted
    assert not os.path.exists(marker)
    # the newest: a state file torch loads, without the loader state rank 1 needs (KeyError on rank 1 only)
    broken = plant(str(root / "step-00000008"), "stream-rank1.pt",
                   lambda p: torch.save({"format": store.FORMAT, "something": 1}, p))
    resumed = accum("run", str(cfg), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    text = resumed.stdout + resumed.stderr
    assert f"--resume auto: skipping checkpoint {root / 'step-00000008'}: it failed to load (" in text, text[-4000:]
    assert "stream-rank1" in text or "KeyError" in text
    assert f"resumed from {root / 'step-00000006'} (step 6" in text, text[-4000:]
    assert not os.path.exists(marker)
    assert os.path.exists(broken.replace("step-00000008", "step-00000008.abandoned"))  # kept, out of sight
    assert steps_of(tmp_path / "run") == list(range(1, 9))
    again = torch.load(tmp_path / "run" / "model.pt", weights_only=True)  # nothing of step 8's load left over
    assert again.keys() == finished.keys() and all(torch.equal(again[k], finished[k]) for k in again)


def test_a_resume_past_lost_metrics_keeps_what_it_rewinds_and_names_the_gap(finished_ddp_run, tmp_path):
    """The issue's probe: delete the two newest checkpoints of a finished run and cut metrics.jsonl in the middle
    of line 6; `--resume` continues from step 12. Before: exit 0 and metrics.jsonl held steps 1-5, 13-16 without a
    word. Now the torn line is detected and kept aside, the resume says steps 6-12 have no line, and `accum-sched
    report` warns about the gap it reads."""
    cfg, run = copy_run(finished_ddp_run, tmp_path)
    for step in (15, 16):
        shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 16
    torn = lines[5][: len(lines[5]) // 2]
    (run / "metrics.jsonl").write_text("".join(lines[:5]) + torn)
    resumed = accum("run", cfg, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {run / 'checkpoints' / 'step-00000012'} (step 12" in resumed.stdout + resumed.stderr
    aside = run / store.REWOUND
    assert (f"warning: metrics.jsonl: a torn line (a worker stopped mid-write) was found and moved to {aside}"
            in resumed.stderr), resumed.stderr[-4000:]
    assert "warning: metrics.jsonl has no line for step(s) 6-12, trained before this checkpoint" in resumed.stderr
    assert aside.read_text() == torn + "\n"  # kept, not deleted
    assert steps_of(run) == [1, 2, 3, 4, 5, 13, 14, 15, 16]
    report = accum("report", str(run))
    if report.returncode == 2 and "matplotlib" in report.stderr:
        pytest.skip("the report extra (matplotlib) is not installed")
    assert report.returncode == 0, report.stderr
    assert f"warning: {run}: metrics.jsonl has no line for step(s) 6-12;" in report.stderr, report.stderr


def test_a_resume_from_an_older_checkpoint_keeps_the_rewound_metrics_aside(finished_ddp_run, tmp_path):
    """`--resume` of step 9 in a finished run: the lines of steps 10-16 move to metrics.rewound.jsonl (said), the
    run writes 10-16 again, and nothing is missing."""
    cfg, run = copy_run(finished_ddp_run, tmp_path)
    old = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    resumed = accum("run", cfg, "--resume", str(run / "checkpoints" / "step-00000009"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert (f"metrics.jsonl: 7 line(s) after step 9 (a future this resume rewinds) moved to {run / store.REWOUND}"
            in resumed.stderr), resumed.stderr[-4000:]
    assert (run / store.REWOUND).read_text() == "".join(old[9:])
    assert steps_of(run) == list(range(1, 17))
    assert "no line for" not in resumed.stderr and "torn" not in resumed.stderr, resumed.stderr[-4000:]


@pytest.mark.parametrize("kind", ["payload", "legacy", "raw"])
def test_every_load_path_refuses_a_planted_or_foreign_pickle_in_one_line(finished_ddp_run, tmp_path, capsys, kind):
    """`accum-sched cbs --from` a checkpoint with a planted trainer.pt exited 1 with torch's advice to load it with
    weights_only=False; a legacy-format or raw pickle gave a traceback and a line saying `--resume` continues. Now
    `cbs --from`, `run --resume PATH` (before launch) and the workers' own load say the same one line, exit 2, and
    nothing of it runs. (`report` and `plan` read no pickle: JSON and the config only.)"""
    from launcher.checkpoint.checkpointer import Checkpointer
    from launcher.checkpoint.pickle_scan import UnsafePickle

    cfg, run = copy_run(finished_ddp_run, tmp_path)
    checkpoint = str(run / "checkpoints" / "step-00000012")
    marker = str(tmp_path / "ran")
    state = {"format": store.FORMAT, "engine": Payload(marker)}
    writers = {
        "payload": lambda p: torch.save(state, p),
        "legacy": lambda p: torch.save({"format": store.FORMAT}, p, _use_new_zipfile_serialization=False),
        "raw": lambda p: write_bytes(p, pickle.dumps(state)),
    }
    path = plant(checkpoint, store.STATE, writers[kind])
    if kind == "payload":
        line = "error: " + PAYLOAD_LINE.format(file=path)
    else:
        line = (f"error: {path}: cannot be loaded (not a torch zip archive: a legacy-format file or a raw pickle, "
                "never written by accum-sched, is not unpickled); nothing of it was run: resume from an earlier "
                "checkpoint (--resume PATH), or start afresh without --resume")
    before = tree(run / "checkpoints")
    assert cli.main(["cbs", cfg, "--from", checkpoint, "--samples", "64"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]
    assert cli.main(["run", cfg, "--resume", checkpoint]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]
    with pytest.raises(UnsafePickle) as info:  # the workers' load, for one who plants it after the launch
        Checkpointer._load(None, path)
    assert "error: " + str(info.value) == line
    assert not os.path.exists(marker) and tree(run / "checkpoints") == before
    assert not (run / "cbs").exists()


def test_force_resume_onto_another_optimizer_drops_its_state_with_a_line(finished_ddp_run, tmp_path):
    """adamw -> sgd under checkpoint.force_resume crashed inside sgd's first step (KeyError: 'momentum'). Now the
    checkpoint's optimizer state is dropped with a line naming both, and sgd trains on from step 12."""
    cfg, run = copy_run(finished_ddp_run, tmp_path)
    for step in (15, 16):
        shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
    resumed = accum("run", cfg, "--resume", "--set", "optimizer.name=sgd", "--set", "optimizer.args={momentum: 0.9}",
                    "--set", "checkpoint.force_resume=true")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert ("warning: checkpoint.force_resume: the optimizer was 'adamw' in the checkpoint, now 'sgd': its state is "
            "dropped, 'sgd' starts afresh at this step (learning rate from the config)") in resumed.stderr
    assert "KeyError" not in resumed.stderr and "Traceback" not in resumed.stderr
    with open(run / "summary.json") as f:
        assert json.load(f)["optimizer_steps"] == 16
    assert steps_of(run) == list(range(1, 17))
