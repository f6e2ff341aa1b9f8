"""Checkpoints under hostile conditions (issue 28.5, docs/reliability.md): SIGKILL during checkpoint writes, ten
times, never leaves a torn checkpoint that resume picks up; a full disk fails the save with one line naming the
cause and the fix and keeps the last good checkpoint."""
from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import paths
from launcher.checkpoint import store

ROOT = paths.ROOT

# One process saving as rank 0 of the workers does: torch.save through store.HashingFile into step-N.tmp, then
# store.commit (manifest, rename) and store.rotate, in a loop. It first resumes (store.find with "auto", then
# torch.load with weights_only) and checks that what it loaded is exactly the step the manifest names.
SAVER = r"""
import os, shutil, sys, torch
from launcher.checkpoint import store
root = sys.argv[1]
found = store.find(root, "auto")
step = 0
if found:
    path, manifest = found
    state = torch.load(os.path.join(path, store.STATE), weights_only=True)
    step = manifest.step
    assert state["step"] == step and torch.equal(state["w"], torch.full((1 << 20,), float(step))), path
print(step, flush=True)
while True:
    step += 1
    final = store.step_dir(root, step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with store.HashingFile(os.path.join(tmp, store.STATE)) as f:  # as Checkpointer._write_file
        torch.save({"step": step, "w": torch.full((1 << 20,), float(step))}, f)
    entry = f.entry
    store.commit(tmp, final, {"format": store.FORMAT, "step": step, "world_size": 1, "config_hash": "x",
                              "config": {}}, {store.STATE: entry})
    store.rotate(root, 2)
"""


@pytest.mark.slow
def test_ten_sigkills_during_checkpoint_writes_never_resume_a_torn_checkpoint(tmp_path):
    root = str(tmp_path / "checkpoints")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rng = random.Random(0)
    resumed, torn = [], 0
    for _ in range(10):
        saver = subprocess.Popen([sys.executable, "-c", SAVER, root], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        line = saver.stdout.readline()
        assert line.strip().isdigit(), saver.communicate(timeout=60)[1][-3000:]  # resumed (and checked) or fresh
        resumed.append(int(line))
        time.sleep(rng.uniform(0.3, 0.8))  # it saves all the time: the kill lands inside a write
        saver.send_signal(signal.SIGKILL)
        saver.wait(timeout=30)
        torn += any(name.endswith(".tmp") for name in os.listdir(root))
        path, manifest = store.find(root, "auto")  # what a resume picks: complete, checksums and all
        state = torch.load(os.path.join(path, store.STATE), weights_only=True)
        assert state["step"] == manifest.step
        assert torch.equal(state["w"], torch.full((1 << 20,), float(state["step"])))
    assert resumed[0] == 0 and all(b > a for a, b in zip(resumed, resumed[1:])), resumed  # progress every time
    assert torn >= 5, f"only {torn} of 10 kills landed inside a write"


def test_a_failed_write_names_the_os_error_not_torchs_stream_error(tmp_path):
    """torch.save reports a write that failed with ENOSPC as '[enforce fail at inline_container.cc] unexpected
    pos'; store.HashingFile raises the OSError naming the file instead."""
    path = str(tmp_path / "trainer.pt")

    class Full:
        name = path

        def __init__(self):
            self.left = 1000

        def write(self, view):
            if len(view) > self.left:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= len(view)
            return len(view)

        def flush(self):
            pass

        def fileno(self):
            return -1

        def close(self):
            pass

    f = store.HashingFile(path)
    f._file.close()
    f._file = Full()
    with pytest.raises(OSError, match=r"No space left on device \(writing .*trainer.pt\)") as info:
        with f:
            torch.save({"w": torch.zeros(10000)}, f)
    assert info.value.errno == errno.ENOSPC


FULL = """\
run: {{output_dir: {out}, seed: 0, epochs: 1}}
task: {{target: builtin:regression, args: {{samples: 256, hidden: 512}}}}
data: {{micro_batch_size: 16}}
accumulation: {{schedule: {{0: 1}}}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{dir: {ckpt}, every_n_steps: 2, keep_last: 1}}
logging: {{progress: plain}}
"""


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 5 MiB: room for one checkpoint of FULL's run (3.4 MB), not for the next beside it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_full_disk_keeps_the_last_good_checkpoint_with_one_clear_line(tmp_path, small_disk, background):
    """With checkpoint.async the failed background write is raised on every rank at the next checkpoint."""
    ckpt = small_disk / "ckpt"
    cfg = tmp_path / "full.yaml"
    cfg.write_text(FULL.format(out=tmp_path / "run", ckpt=ckpt)
                   .replace("keep_last: 1}", f"keep_last: 1, async: {str(background).lower()}}}"))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", str(cfg)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    good = str(ckpt / "step-00000002")
    lines = [line for line in proc.stderr.splitlines() if "CheckpointError: " in line]
    assert lines, proc.stderr[-4000:]
    for line in lines:
        assert "failed: rank 0: OSError: [Errno 28] No space left on device (writing " in line, line
        assert f"the last good checkpoint, {good}, is kept: free space on {ckpt} (or set checkpoint.dir " in line
        assert "then continue with `accum-sched run CONFIG --resume`" in line
    assert sorted(os.listdir(ckpt)) == ["step-00000002"]  # the torn step-4.tmp is gone, its space back
    assert store.verify(good)[1] is None


class Payload:
    """Unpickled, it creates the directory ``marker``: proof that a pickle ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


@pytest.mark.parametrize("name", [store.STATE, "window-rank0.pt", "stream-rank1.pt"])
def test_a_malicious_pickle_in_our_state_files_is_never_run(tmp_path, name):
    from launcher.checkpoint.checkpointer import Checkpointer, CheckpointError
    from launcher.checkpoint.pickle_scan import UnsafePickle

    marker = str(tmp_path / "ran")
    path = str(tmp_path / name)
    torch.save({"format": store.FORMAT, "window": Payload(marker)}, path)
    with pytest.raises(CheckpointError) as info:
        Checkpointer._load(None, path)  # as resume loads trainer.pt, window-rank<R>.pt and stream-rank<R>.pt
    assert not os.path.exists(marker)
    assert isinstance(info.value, UnsafePickle)  # the worker says it in one line (launcher/worker.py)
    assert str(info.value) == (f"{path}: cannot be loaded (it would import os.makedirs, refused by weights_only); "
                               "nothing of it was run: resume from an earlier checkpoint (--resume PATH), or start "
                               "afresh without --resume")
    with open(path, "r+b") as f:  # truncated: one line too
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"cannot be loaded \(RuntimeError: .*; nothing of it was run"):
        Checkpointer._load(None, path)


def test_dcp_metadata_is_checked_before_torch_unpickles_it(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    from launcher.checkpoint import dcp_metadata

    good = str(tmp_path / "good")
    dcp.save({"model": {"w": torch.ones(3, 2)}, "step": 3}, checkpoint_id=good)  # one process, no group
    dcp_metadata.check_tree(good)
    marker = str(tmp_path / "ran")
    with open(os.path.join(good, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)
    with pytest.raises(dcp_metadata.UnsafeMetadata, match=r"\.metadata: would import os\.makedirs when unpickled"):
        dcp_metadata.check_tree(str(tmp_path))
    assert not os.path.exists(marker)
    with open(os.path.join(good, ".metadata"), "wb") as f:
        f.write(b"\x80\x04\x95")
    with pytest.raises(dcp_metadata.UnsafeMetadata, match="not readable DCP metadata"):
        dcp_metadata.check_tree(good)


FSDP = """\
run: {{output_dir: {out}, seed: 0, epochs: 1}}
task: {{target: builtin:regression, args: {{samples: 128}}}}
data: {{micro_batch_size: 16}}
accumulation: {{schedule: {{0: 1}}}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: fsdp, nproc_per_node: 2, fsdp: {{wrap: [Linear]}}}}
checkpoint: {{every_n_steps: 2, keep_last: 2}}
logging: {{progress: plain}}
"""


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
@pytest.mark.slow
def test_a_planted_pickle_with_a_rewritten_manifest_is_refused_on_resume(tmp_path, backend):
    """The checksums cannot stop one who rewrites manifest.json too. FSDP2: DCP's .metadata, which torch reads with
    a plain pickle.load; DDP: trainer.pt, read with weights_only. Either way nothing of it runs, on any rank, every
    rank stops, and the command's last line names the file and the import."""
    import hashlib
    import json
    import pickle

    cfg = tmp_path / "cfg.yaml"
    text = FSDP.format(out=tmp_path / "run")
    if backend == "ddp":
        text = text.replace("backend: fsdp, nproc_per_node: 2, fsdp: {wrap: [Linear]}",
                            "backend: ddp, nproc_per_node: 2")
    cfg.write_text(text)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def accum(*args):
        return subprocess.run([sys.executable, "-m", "launcher", "run", str(cfg), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    first = accum()
    assert first.returncode == 0, first.stderr[-4000:]
    ckpt = store.list_checkpoints(str(tmp_path / "run" / "checkpoints"))[-1][1]
    manifest_path = os.path.join(ckpt, store.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    marker = str(tmp_path / "ran")
    if backend == "fsdp":
        [rel] = [r for r in manifest["files"] if os.path.basename(r) == ".metadata"]
        with open(os.path.join(ckpt, rel), "wb") as f:
            pickle.dump(Payload(marker), f)
        line = (f"{os.path.join(ckpt, rel)}: would import os.makedirs when unpickled, which DCP metadata never "
                "does: refused, nothing of it was run; resume from an earlier checkpoint (--resume PATH), or start "
                "afresh without --resume")
    else:
        rel = store.STATE
        torch.save({"format": store.FORMAT, "engine": Payload(marker)}, os.path.join(ckpt, rel))
        line = (f"{os.path.join(ckpt, rel)}: cannot be loaded (it would import os.makedirs, refused by weights_only); "
                "nothing of it was run: resume from an earlier checkpoint (--resume PATH), or start afresh without "
                "--resume")
    with open(os.path.join(ckpt, rel), "rb") as f:
        data = f.read()
    manifest["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    resumed = accum("--resume", ckpt)  # bounded by the timeout: every rank stops, none waits
    assert resumed.returncode == 2, resumed.stderr[-3000:]  # bad input: the command exits 2
    assert not os.path.exists(marker)  # on no rank
    # every rank that read it says so in one line (a rank that refused it first may leave the other failing in a
    # collective); the command adds no summary of its own, the cause being printed as it is
    assert "error: " + line in resumed.stderr.splitlines(), resumed.stderr[-4000:]
    assert " failed first: " not in resumed.stderr


EDITS = [
    ("not-json", lambda m: "garbage", "unreadable (Expecting value"),
    ("a-list", lambda m: [], "not a format-1 accum-sched manifest"),
    ("step-a-word", lambda m: {**m, "step": "many"}, "a field has a value of the wrong kind"),
    ("bytes-a-word", lambda m: {**m, "files": {store.STATE: {**m["files"][store.STATE], "bytes": "x"}}},
     "the manifest says x (truncated or torn)"),
    ("newer-version", lambda m: {**m, "version": 99}, "version 99"),
]


@pytest.mark.parametrize("name,edit,problem", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_manifest_is_named_and_skipped(tmp_path, name, edit, problem):
    import json

    from launcher.errors import ConfigError

    root = str(tmp_path)
    paths_ = []
    for step in (2, 4):
        tmp = store.step_dir(root, step) + ".tmp"
        os.makedirs(tmp)
        with store.HashingFile(os.path.join(tmp, store.STATE)) as f:
            torch.save({"step": step}, f)
        store.commit(tmp, store.step_dir(root, step), {"format": store.FORMAT, "step": step, "world_size": 1,
                                                       "config_hash": "x", "config": {}}, {store.STATE: f.entry})
        paths_.append(store.step_dir(root, step))
    mpath = os.path.join(paths_[-1], store.MANIFEST)
    with open(mpath) as f:
        edited = edit(json.load(f))
    with open(mpath, "w") as f:
        f.write(edited if isinstance(edited, str) else json.dumps(edited))
    skipped = []
    assert store.find(root, "auto", skipped.append)[0] == paths_[0]  # auto falls back to the one before
    assert len(skipped) == 1 and problem in skipped[0], skipped
    with pytest.raises(ConfigError, match="pick another checkpoint, or --resume auto") as info:
        store.find(root, paths_[-1])  # named explicitly: refused in one line, exit 2 before launch
    assert problem in str(info.value) and "\n" not in str(info.value)


def _commit_config(tmp, name, background: bool) -> str:
    from test_checkpoint import CONFIG, DROPOUT

    path = tmp / f"{name}.yaml"
    path.write_text(CONFIG.format(out=tmp / name, args=DROPOUT, lr_scheduler="{name: cosine, warmup_steps: 2}")
                    .replace("faulty_tasks:regression", "kill_commit_tasks:regression")
                    .replace("keep_last: 3}", f"keep_last: 3, async: {str(background).lower()}}}"))
    return str(path)


def _commit_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT_", "KILL_COMMIT_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + paths.TESTS
    return env


def _run(*args, extra=None):
    return subprocess.run([sys.executable, "-m", "launcher", "run", *args], cwd=paths.TESTS,
                          env={**_commit_env(), **(extra or {})}, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted_commit_run(tmp_path_factory):
    """The run of the kill-in-commit config, uninterrupted, with synchronous checkpoints: its output directory.
    Where checkpoints are written does not change the training, so it is also the asynchronous run's end."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    ref = _run(_commit_config(tmp, "ref", background=False))
    assert ref.returncode == 0, ref.stderr[-3000:]
    return str(tmp / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_run_sigkilled_inside_a_checkpoint_commit_resumes_exactly(tmp_path, uninterrupted_commit_run, background):
    """The whole run SIGKILLed (agent, and with it the workers) while rank 0 commits its third checkpoint, then
    `--resume`: the torn step-12.tmp is ignored, the run continues from step 8 and ends bit for bit where an
    uninterrupted run ends. With checkpoint.async the commit waits in the background thread while training goes
    on, until the next checkpoint waits for it."""
    from test_checkpoint import assert_same_bits, outputs

    from launcher.launch import rundir

    env = _commit_env()
    cfg, run, marker = _commit_config(tmp_path, "run", background), tmp_path / "run", tmp_path / "committing"
    victim = subprocess.Popen([sys.executable, "-m", "launcher", "run", cfg], cwd=paths.TESTS, start_new_session=True,
                              env={**env, "KILL_COMMIT_AT": "3", "KILL_COMMIT_MARKER": str(marker)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "rank 0 never reached its third commit"
    finally:
        os.killpg(victim.pid, signal.SIGKILL)  # accum-sched run and torchrun; the workers follow (parent death)
        victim.wait(timeout=30)
    deadline = time.monotonic() + 60
    while True:  # the lock is free once the last worker is gone
        try:
            rundir.release(rundir.hold(str(run)))
            break
        except rundir.ConfigError:
            assert time.monotonic() < deadline, "workers outlived the killed run"
            time.sleep(0.2)
    assert f"async: {str(background).lower()}" in (run / "config.yaml").read_text()  # the mode the run ran in
    root = run / "checkpoints"
    assert sorted(os.listdir(root)) == ["step-00000004", "step-00000008", "step-00000012.tmp"]
    assert store.MANIFEST not in os.listdir(root / "step-00000012.tmp")  # torn: written, never committed
    resumed = _run(cfg, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {root / 'step-00000008'}" in resumed.stdout + resumed.stderr
    assert_same_bits(str(run), outputs(uninterrupted_commit_run))
