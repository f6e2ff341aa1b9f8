"""The checkpoint manifest and the resume plan, in one process on real files: the typed Manifest round trip and its
JSON keys, migration from every manifest older releases wrote, and `accum-sched run`'s preflight and the workers'
Checkpointer reaching the same verdict through the one plan_resume."""
from __future__ import annotations

import copy
import hashlib
import json
import os

import pytest

from launcher.checkpoint import resume as resume_checks
from launcher.checkpoint import store
from launcher.checkpoint.manifest import MANIFEST, VERSION, Manifest, ManifestError, migrate
from launcher.checkpoint.resume import plan_resume
from launcher.config import validate
from launcher.errors import ConfigError

BASE = {"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 8},
        "accumulation": {"schedule": {0: 1, 2: 2}}, "distributed": {"nproc_per_node": 2}}

# the keys manifest.json has held since the first checkpoints (launcher/checkpoint.py at e0d10d2)
V1_KEYS = {"format", "step", "epoch", "micro_batch", "batches_per_epoch", "world_size", "factor_scale",
           "micro_batch_size", "config_hash", "config", "reason", "deepspeed", "skipped_steps", "created", "files"}

# As older releases wrote them (values as a 2-worker run of BASE would have; config left short: not compared here).
V1 = {"format": 1, "step": 8, "epoch": 0, "micro_batch": 8, "batches_per_epoch": 16, "world_size": 2,
      "factor_scale": [1, 1], "micro_batch_size": 8, "config_hash": "0" * 64, "config": {"run": {"seed": 0}},
      "reason": "step", "deepspeed": False, "skipped_steps": 1, "created": 1733300000.5,
      "files": {"trainer.pt": {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}}
V2 = dict(V1, step=9, micro_batch=11, reason="preempt", partial_window=True)  # stops inside a window (issue 12)
# what tests and hand-made folders commit: only some fields
PARTIAL = {"format": 1, "step": 4, "world_size": 2, "config_hash": "0" * 64, "config": {}}


def config(tmp_path, **sections):
    raw = copy.deepcopy(BASE)
    raw["run"] = {"output_dir": str(tmp_path / "run")}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return validate(raw)


def test_round_trip_keeps_the_keys_on_disk_and_adds_version():
    m = migrate(V2)
    assert m.to_dict().keys() == V1_KEYS | {"partial_window", "version", "stream"}
    assert Manifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert m.factor_scale == (1, 1) and m.to_dict()["factor_scale"] == [1, 1]
    assert m["step"] == 9 and m.get("missing", 5) == 5  # the dict-style reads of older callers still work
    with pytest.raises(ManifestError, match="lacks partial_window, stream, version"):
        Manifest.from_dict(V1)  # from_dict is strict: an older one goes through migrate


def test_migrate_reads_every_older_manifest():
    v1 = migrate(V1)
    assert (v1.version, v1.partial_window, v1.step, v1.world_size, v1.batches_per_epoch) == (VERSION, False, 8, 2, 16)
    assert v1.files == V1["files"] and v1.created == V1["created"]
    v2 = migrate(V2)
    assert (v2.version, v2.partial_window, v2.micro_batch, v2.reason) == (VERSION, True, 11, "preempt")
    assert migrate(migrate(V2).to_dict()) == v2  # the current version migrates to itself
    part = migrate(PARTIAL)
    assert (part.step, part.world_size, part.factor_scale, part.partial_window, part.files) == (4, 2, (1, 1), False, {})
    assert migrate(dict(V1, future_field=1)) == v1  # keys it does not know are dropped
    with pytest.raises(ManifestError, match="newer than this accum-sched reads"):
        migrate(dict(V2, version=VERSION + 1))
    with pytest.raises(ManifestError, match="wrong kind"):
        migrate(dict(V1, world_size="two"))


def _checkpoint(root, name, manifest: dict):
    """A committed-looking checkpoint folder holding ``manifest`` as written (trainer.pt = b"abc")."""
    path = os.path.join(root, name)
    os.makedirs(path)
    with open(os.path.join(path, store.STATE), "wb") as f:
        f.write(b"abc")
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    return path


def test_old_manifests_on_disk_are_found_and_newer_ones_are_refused(tmp_path):
    cfg = config(tmp_path)
    root = store.checkpoint_root(cfg)
    current = {"config_hash": store.config_hash(cfg), "config": store.training_config(cfg)}
    first = _checkpoint(root, "step-00000008", dict(V1, **current))
    path, m = store.find(root, "auto")
    assert path == first and isinstance(m, Manifest) and m.partial_window is False and m.version == VERSION
    plan = plan_resume(cfg, 2, "auto")
    assert (plan.path, plan.manifest, plan.scale, plan.diffs) == (first, m, (1, 1), ())

    newer = _checkpoint(root, "step-00000009-mb000011", dict(V2, version=VERSION + 1, **current))
    problems = []
    assert store.find(root, "auto", problems.append)[0] == first  # auto falls back past it, saying why
    assert problems == [(f"skipping damaged checkpoint: {os.path.join(newer, MANIFEST)}: manifest version "
                         f"{VERSION + 1} is newer than this accum-sched reads ({VERSION}); resume it with the "
                         f"release that wrote it")]
    with pytest.raises(ConfigError, match="newer than this accum-sched"):
        store.find(root, newer)


def test_a_version_3_manifest_migrates_to_one_without_stream_state():
    v3 = migrate(dict(V2, version=3))
    assert (v3.version, v3.stream, v3.partial_window, v3.micro_batch) == (VERSION, False, True, 11)


def test_a_committed_manifest_has_the_old_keys_plus_version(tmp_path):
    tmp = str(tmp_path / "step-00000004.tmp")
    os.makedirs(tmp)
    with open(os.path.join(tmp, store.STATE), "wb") as f:
        f.write(b"abc")
    store.commit(tmp, str(tmp_path / "step-00000004"), Manifest(step=4, world_size=2, reason="epoch"))
    with open(tmp_path / "step-00000004" / MANIFEST) as f:
        raw = json.load(f)
    assert raw.keys() == V1_KEYS | {"partial_window", "version", "stream"} and raw["version"] == VERSION
    assert raw["stream"] is False
    assert raw["files"] == V1["files"] and raw["factor_scale"] == [1, 1]


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


