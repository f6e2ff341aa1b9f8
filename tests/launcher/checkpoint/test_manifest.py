"""The checkpoint manifest and the resume plan, in one process on real files: the typed Manifest round trip and its
JSON keys, the refusal of a manifest another version wrote (0.1.0 was never released: nothing to migrate), and
`accum-sched run`'s preflight and the workers' Checkpointer reaching the same verdict through the one plan_resume."""
from __future__ import annotations

import copy
import hashlib
import json
import os

import pytest

from launcher.checkpoint import manifest as manifests
from launcher.checkpoint import resume as resume_checks
from launcher.checkpoint import store
from launcher.checkpoint.manifest import MANIFEST, VERSION, Manifest, ManifestError
from launcher.checkpoint.resume import plan_resume
from launcher.config import validate
from launcher.errors import ConfigError

BASE = {"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 8},
        "accumulation": {"schedule": {0: 1, 2: 2}}, "distributed": {"nproc_per_node": 2}}

# the keys of manifest.json (docs/checkpoints.md)
KEYS = {"format", "version", "step", "epoch", "micro_batch", "batches_per_epoch", "world_size", "factor_scale",
        "micro_batch_size", "config_hash", "config", "reason", "backend", "sharded", "skipped_steps", "created",
        "partial_window", "stream", "files"}

CURRENT = {"format": 1, "version": VERSION, "step": 9, "epoch": 0, "micro_batch": 11, "batches_per_epoch": 16,
           "world_size": 2, "factor_scale": [1, 1], "micro_batch_size": 8, "config_hash": "0" * 64,
           "config": {"run": {"seed": 0}}, "reason": "preempt", "backend": "fsdp", "sharded": True,
           "skipped_steps": 1, "created": 1733300000.5, "partial_window": True, "stream": False,
           "files": {"trainer.pt": {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}}
# As earlier development versions wrote them: version 4 (a `deepspeed` flag), and version 2 (no `version` key)
EARLIER = dict({k: v for k, v in CURRENT.items() if k not in ("backend", "sharded")}, version=4, deepspeed=False)
UNVERSIONED = {k: v for k, v in EARLIER.items() if k not in ("version", "stream")}


def config(tmp_path, **sections):
    raw = copy.deepcopy(BASE)
    raw["run"] = {"output_dir": str(tmp_path / "run")}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return validate(raw)


def test_round_trip_keeps_the_keys_on_disk():
    m = manifests.read(CURRENT)
    assert m.to_dict().keys() == KEYS and (m.backend, m.sharded) == ("fsdp", True)
    assert Manifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert m.factor_scale == (1, 1) and m.to_dict()["factor_scale"] == [1, 1]
    assert manifests.read(dict(CURRENT, future_field=1)) == m  # keys it does not know are dropped
    part = manifests.read({"version": VERSION, "step": 4, "world_size": 2})  # hand-made: the rest at defaults
    assert (part.step, part.world_size, part.factor_scale, part.backend, part.sharded) == (4, 2, (1, 1), "", False)
    with pytest.raises(ManifestError, match="lacks backend, batches_per_epoch"):
        Manifest.from_dict({"step": 4})  # from_dict is strict
    with pytest.raises(ManifestError, match="wrong kind"):
        manifests.read(dict(CURRENT, world_size="two"))


@pytest.mark.parametrize("raw, says", [
    (EARLIER, f"manifest version 4, this one reads {VERSION}"),
    (UNVERSIONED, f"manifest version 1 or 2, this one reads {VERSION}"),
])
def test_a_manifest_of_an_earlier_development_version_is_refused(raw, says):
    with pytest.raises(ManifestError) as caught:
        manifests.read(raw)
    assert str(caught.value).startswith("written by an earlier development version of accum-sched (" + says)
    assert "\n" not in str(caught.value)
    with pytest.raises(ManifestError, match="newer than this accum-sched reads"):
        manifests.read(dict(CURRENT, version=VERSION + 1))


def _checkpoint(root, name, manifest: dict):
    """A committed-looking checkpoint folder holding ``manifest`` as written (trainer.pt = b"abc")."""
    path = os.path.join(root, name)
    os.makedirs(path)
    with open(os.path.join(path, store.STATE), "wb") as f:
        f.write(b"abc")
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    return path


def test_other_versions_on_disk_are_skipped_by_auto_and_refused_by_name(tmp_path):
    cfg = config(tmp_path)
    root = store.checkpoint_root(cfg)
    current = {"config_hash": store.config_hash(cfg), "config": store.training_config(cfg)}
    first = _checkpoint(root, "step-00000008", dict(CURRENT, step=8, micro_batch=8, partial_window=False,
                                                    backend="ddp", sharded=False, **current))
    path, m = store.find(root, "auto")
    assert path == first and isinstance(m, Manifest) and (m.backend, m.version) == ("ddp", VERSION)
    plan = plan_resume(cfg, 2, "auto")
    assert (plan.path, plan.manifest, plan.scale, plan.diffs) == (first, m, (1, 1), ())

    newer = _checkpoint(root, "step-00000009-mb000011", dict(CURRENT, version=VERSION + 1, **current))
    older = _checkpoint(root, "step-00000010", dict(EARLIER, step=10, **current))
    problems = []
    assert store.find(root, "auto", problems.append)[0] == first  # auto falls back past both, saying why
    assert problems == [
        f"skipping damaged checkpoint: {os.path.join(older, MANIFEST)}: written by an earlier development version "
        f"of accum-sched (manifest version 4, this one reads {VERSION}); start afresh without --resume, or resume "
        f"it with the version that wrote it",
        f"skipping damaged checkpoint: {os.path.join(newer, MANIFEST)}: manifest version {VERSION + 1} is newer "
        f"than this accum-sched reads ({VERSION}); resume it with the release that wrote it"]
    with pytest.raises(ConfigError, match="newer than this accum-sched"):
        store.find(root, newer)


def test_run_refuses_an_earlier_versions_checkpoint_in_one_line_with_exit_2(tmp_path, capsys):
    """The usual path: `accum-sched run --resume CHECKPOINT` stops before anything is written or launched."""
    from launcher.cli import main

    cfg = config(tmp_path)
    current = {"config_hash": store.config_hash(cfg), "config": store.training_config(cfg)}
    older = _checkpoint(store.checkpoint_root(cfg), "step-00000010", dict(EARLIER, step=10, **current))
    path = tmp_path / "config.json"  # JSON is YAML
    path.write_text(json.dumps(dict(copy.deepcopy(BASE), run={"output_dir": str(tmp_path / "run")})))
    assert main(["run", str(path), "--resume", older, "--set", "distributed.process_group=gloo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --resume: checkpoint {os.path.join(older, MANIFEST)}: written by an earlier development "
                   f"version of accum-sched (manifest version 4, this one reads {VERSION}); start afresh without "
                   f"--resume, or resume it with the version that wrote it; pick another checkpoint, or --resume "
                   f"auto for the newest valid one"]
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing launched


def test_a_committed_manifest_has_every_key(tmp_path):
    tmp = str(tmp_path / "step-00000004.tmp")
    os.makedirs(tmp)
    with open(os.path.join(tmp, store.STATE), "wb") as f:
        f.write(b"abc")
    store.commit(tmp, str(tmp_path / "step-00000004"), Manifest(step=4, world_size=2, reason="epoch",
                                                              backend="deepspeed", sharded=True))
    with open(tmp_path / "step-00000004" / MANIFEST) as f:
        raw = json.load(f)
    assert raw.keys() == KEYS and raw["version"] == VERSION and "deepspeed" not in raw
    assert (raw["backend"], raw["sharded"], raw["stream"]) == ("deepspeed", True, False)
    assert raw["files"] == CURRENT["files"] and raw["factor_scale"] == [1, 1]


# -- one verdict before launch and in the workers ---------------------------------------------------------------
def _saved(tmp_path, cfg, **fields):
    """A checkpoint of a 2-worker run of ``cfg`` at step 8, committed as the Checkpointer commits."""
    root = store.checkpoint_root(cfg)
    os.makedirs(root, exist_ok=True)
    tmp = store.step_dir(root, 8) + ".tmp"
    os.makedirs(tmp)
    with open(os.path.join(tmp, store.STATE), "wb") as f:
        f.write(b"abc")
    manifest = Manifest(step=8, epoch=0, micro_batch=8, batches_per_epoch=16, world_size=2, micro_batch_size=8,
                        config_hash=store.config_hash(cfg), config=store.training_config(cfg), reason="step",
                        **fields)
    store.commit(tmp, store.step_dir(root, 8), manifest)
    return store.step_dir(root, 8)


def _verdicts(cfg, world):
    """What preflight (login node, cfg.world_size) and a worker's Checkpointer (rank 0 of ``world``) say."""
    from launcher.checkpoint.checkpointer import Checkpointer, CheckpointError

    assert cfg.world_size == world
    try:
        resume_checks.preflight(cfg, "auto")
        before = None
    except ConfigError as exc:
        before = exc.line()
    try:
        worker = Checkpointer(cfg, 0, world, "auto").plan
    except CheckpointError as exc:
        worker = str(exc)
    return before, worker


@pytest.mark.parametrize("change, world, starts", [
    ({"optimizer": {"lr": 0.5}}, 2, "optimizer.lr: is 0.5 but checkpoint "),
    ({"distributed": {"nproc_per_node": 1}}, 1, "checkpoint.on_world_change: is 'error' and checkpoint "),
    ({"distributed": {"nproc_per_node": 4}, "checkpoint": {"on_world_change": "keep_global_batch"}}, 4,
     "checkpoint.on_world_change: keep_global_batch cannot keep its promise on 4 workers"),
])
def test_preflight_and_worker_refuse_with_the_same_line(tmp_path, change, world, starts):
    path = _saved(tmp_path, config(tmp_path))
    before, worker = _verdicts(config(tmp_path, **change), world)
    assert before == worker and before.startswith(starts) and path in before


def test_a_partial_window_refuses_another_world_in_both(tmp_path):
    _saved(tmp_path, config(tmp_path), partial_window=True)
    before, worker = _verdicts(config(tmp_path, distributed={"nproc_per_node": 1},
                                      checkpoint={"on_world_change": "keep_factor"}), 1)
    assert before == worker and "taken inside an accumulation window" in before


def test_preflight_and_worker_accept_with_the_same_plan(tmp_path, capsys):
    path = _saved(tmp_path, config(tmp_path))
    forced = config(tmp_path, optimizer={"lr": 0.5}, checkpoint={"force_resume": True})
    plan = plan_resume(forced, 2, "auto")
    assert _verdicts(forced, 2) == (None, plan)
    assert plan.path == path and plan.diffs == (("optimizer.lr", 0.001, 0.5),)
    assert plan.warnings() == ["warning: checkpoint.force_resume: optimizer.lr was 0.001 in the checkpoint, now 0.5"]

    fewer = config(tmp_path, distributed={"nproc_per_node": 1}, checkpoint={"on_world_change": "keep_global_batch"})
    before, worker = _verdicts(fewer, 1)
    assert before is None and worker.scale == (2, 1)
    assert worker.schedule(fewer.schedule_for(1)).milestones == ((0, 2), (2, 4))  # micro x factor x world kept


def test_auto_with_nothing_to_resume_starts_afresh_in_both(tmp_path, capsys):
    cfg = config(tmp_path)
    assert _verdicts(cfg, 2) == (None, plan_resume(cfg, 2, "auto"))
    root = os.path.abspath(store.checkpoint_root(cfg))
    assert f"accum-sched: --resume auto: no checkpoint in {root} yet; starting afresh" in capsys.readouterr().out
    assert plan_resume(cfg, 2, None).fresh and not plan_resume(cfg, 2, "auto").fresh




@pytest.mark.parametrize("backend, refused", [("deepspeed", True), ("fsdp", False), ("ddp", False)])
def test_the_back_end_that_wrote_a_checkpoint_decides_whether_it_resumes_on_another_world(tmp_path, backend, refused):
    _saved(tmp_path, config(tmp_path), backend=backend, sharded=backend != "ddp")
    fewer = config(tmp_path, distributed={"nproc_per_node": 1}, checkpoint={"on_world_change": "keep_factor"})
    before, worker = _verdicts(fewer, 1)
    if refused:  # DeepSpeed's per-rank shards: refused before launch and in the workers alike
        assert before == worker and "DeepSpeed checkpoints hold per-rank shards" in before
    else:  # FSDP2's DCP shards reshard; DDP's trainer.pt holds the whole state
        assert before is None and worker.scale == (1, 1)
