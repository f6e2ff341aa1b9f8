"""Checkpoint pieces in one process, no launch: commit/verify/find on real files, metrics truncation, the config
identity, the world-size policy, the re-dealt sample order, and RNG states through weights_only loading."""
from __future__ import annotations

import io
import json
import os
import random

import pytest

from launcher.checkpoint import resume, store
from launcher.config import validate
from launcher.errors import ConfigError

BASE = {"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 8},
        "accumulation": {"schedule": {0: 1, 2: 2}}, "distributed": {"nproc_per_node": 2}}


def config(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return validate(raw)


def make(root, step, payload=b"x" * 100, world=2, cfg=None):
    tmp = store.step_dir(root, step) + ".tmp"
    os.makedirs(os.path.join(tmp, "deepspeed"))
    with open(os.path.join(tmp, store.STATE), "wb") as f:
        f.write(payload)
    with open(os.path.join(tmp, "deepspeed", "shard.pt"), "wb") as f:
        f.write(payload[::-1])
    cfg = cfg or config()
    store.commit(tmp, store.step_dir(root, step), {"format": store.FORMAT, "step": step, "world_size": world,
                                                   "config_hash": store.config_hash(cfg),
                                                   "config": store.training_config(cfg)})
    return store.step_dir(root, step)


def test_commit_verify_find_fall_back_and_rotate(tmp_path):
    root = str(tmp_path)
    first, second, third = make(root, 4), make(root, 8), make(root, 12)
    os.makedirs(store.step_dir(root, 16) + ".tmp")  # a save that died half way: invisible
    assert [s for s, _ in store.list_checkpoints(root)] == [4, 8, 12]
    assert store.verify(third) == (store.verify(third)[0], None)
    assert set(store.verify(third)[0].files) == {"trainer.pt", os.path.join("deepspeed", "shard.pt")}

    shard = os.path.join(third, "deepspeed", "shard.pt")
    with open(shard, "r+b") as f:
        f.write(b"y")  # same size, other bytes
    os.truncate(os.path.join(second, store.STATE), 50)
    problems = []
    path, manifest = store.find(root, "auto", problems.append)
    assert path == first and manifest.step == 4
    assert problems == [f"skipping damaged checkpoint: {shard}: sha256 differs from the manifest (corrupted)",
                        f"skipping damaged checkpoint: {os.path.join(second, store.STATE)}: 50 bytes, the manifest "
                        f"says 100 (truncated or torn)"]
    with pytest.raises(ConfigError, match="sha256 differs"):  # named explicitly: no silent fallback
        store.find(root, third, None)
    assert store.find(root, os.path.join(first, store.MANIFEST), None)[0] == first
    assert store.find(str(tmp_path / "empty"), "auto") is None

    os.remove(os.path.join(first, store.MANIFEST))
    with pytest.raises(ConfigError, match="none of the 3 checkpoints"):
        store.find(root, "auto")

    make(root, 20)
    removed = store.rotate(root, 2)
    assert sorted(os.path.basename(p) for p in removed) == ["step-00000004", "step-00000008", "step-00000016.tmp"]
    assert [s for s, _ in store.list_checkpoints(root)] == [12, 20]
    aside = store.set_aside(store.step_dir(root, 12))
    assert aside.endswith("step-00000012.abandoned") and [s for s, _ in store.list_checkpoints(root)] == [20]


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    lines = [json.dumps({"step": s, "loss": float("nan") if s == 2 else 0.5}) + "\n" for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 6, "lo')  # a torn last line
    assert store.truncate_metrics(str(tmp_path), 3) == 3
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:3])
    assert store.truncate_metrics(str(tmp_path / "none"), 3) == 0


def test_config_identity_names_the_field_and_ignores_what_does_not_train():
    cfg = config()
    manifest = {"config_hash": store.config_hash(cfg), "config": store.training_config(cfg)}
    same = config(run={"output_dir": "elsewhere"}, logging={"progress": "none"}, checkpoint={"keep_last": 5},
                  distributed={"nproc_per_node": 4, "max_restarts": 3})
    assert store.config_differences(manifest, same) == []
    other = config(optimizer={"lr": 0.5}, accumulation={"schedule": "0:1,2:4"})
    assert store.config_differences(manifest, other) == [("accumulation.schedule", [[0, 1], [2, 2]], [[0, 1], [2, 4]]),
                                                         ("optimizer.lr", 0.001, 0.5)]
    with pytest.raises(ConfigError) as exc:
        resume.check_config("ck", manifest, other)
    assert exc.value.line().startswith("accumulation.schedule: is [[0, 1], [2, 4]] but checkpoint ck was made with "
                                       "[[0, 1], [2, 2]] (and 1 more field(s)); ")
    forced = config(optimizer={"lr": 0.5}, checkpoint={"force_resume": True})
    assert resume.check_config("ck", manifest, forced) == [("optimizer.lr", 0.001, 0.5)]
    # a key the checkpoint does not record counts as its default (older releases recorded defaults too)
    older = {"config_hash": "old", "config": json.loads(json.dumps(manifest["config"]))}
    older["config"]["accumulation"]["lr_coupling"] = "none"
    assert store.config_differences(older, cfg) == []


def test_world_size_policy():
    ck = {"world_size": 2, "factor_scale": [1, 1]}
    assert resume.factor_scale(ck, config(), 2) == (1, 1)
    with pytest.raises(ConfigError, match=r"^checkpoint.on_world_change: is 'error' and checkpoint was made by 2"):
        resume.factor_scale(ck, config(), 1)
    keep = config(checkpoint={"on_world_change": "keep_global_batch"})
    assert resume.factor_scale(ck, keep, 1) == (2, 1)  # {0: 2, 2: 4} on one worker
    assert resume.scaled_milestones(keep.schedule.milestones, (2, 1)) == {0: 2, 2: 4}
    assert resume.factor_scale(ck, config(accumulation={"schedule": {0: 2, 2: 4}},
                                         checkpoint={"on_world_change": "keep_global_batch"}), 4) == (1, 2)
    with pytest.raises(ConfigError, match="entry 0: 1 would need factor 0.5"):
        resume.factor_scale(ck, keep, 4)
    assert resume.factor_scale({"world_size": 1, "factor_scale": [2, 1]}, keep, 2) == (1, 1)  # back to the start
    assert resume.factor_scale(ck, config(checkpoint={"on_world_change": "keep_factor"}), 3) == (1, 1)
    # global_batch: the config already keeps the global batch; keep_factor has to undo that
    gb = {"schedule": None, "global_batch": 32}
    assert resume.factor_scale(ck, config(accumulation=gb, checkpoint={"on_world_change": "keep_global_batch"}), 1) \
        == (1, 1)
    assert resume.factor_scale(ck, config(accumulation=gb, checkpoint={"on_world_change": "keep_factor"}), 1) == (1, 2)


def test_redealt_order_and_rng_states_survive_weights_only():
    import numpy as np
    import torch
    from torch.utils.data import DistributedSampler

    from launcher.checkpoint.checkpointer import deal, global_order, rng_state, set_rng_state

    data = list(range(37))
    order = global_order(data, epoch=3, world=2, shuffle=True, seed=5)
    shards = []
    for r in range(2):
        s = DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=5)
        s.set_epoch(3)
        shards.append(list(s))
    assert order[:2 * 8] == [i for j in range(8) for i in (shards[0][j], shards[1][j])]  # micro-batches are a prefix
    assert [deal(order, 2, r) for r in range(2)] == shards  # dealing the whole order again gives the shards back
    rest = order[2 * 8:]
    shares = [deal(rest, 3, r) for r in range(3)]
    assert [len(s) for s in shares] == [8, 8, 8] and set(sum(shares, [])) == set(rest)  # 37 -> 38 (2 ranks); 22 -> 24

    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    buf = io.BytesIO()
    torch.save({"rng": rng_state(torch.device("cpu"))}, buf)
    want = (torch.rand(3), random.random(), np.random.rand())
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True)["rng"], torch.device("cpu"))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]
