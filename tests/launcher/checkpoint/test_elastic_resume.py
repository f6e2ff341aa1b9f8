"""Which checkpoint a re-formed elastic group continues from (launcher/checkpoint/resume.py: plan_resume with
elastic=True, docs/elastic.md): the newest one its world size can use. A checkpoint committed inside a window (the
SIGTERM torchrun sends before re-forming) is usable only on its own world size; on another one the group goes
back to the newest window boundary, or starts afresh when there is none."""
from __future__ import annotations

import os

from launcher.checkpoint import store
from launcher.checkpoint.manifest import Manifest
from launcher.checkpoint.resume import plan_resume, usable_on
from launcher.config import validate


def config(tmp_path):
    return validate({"run": {"output_dir": str(tmp_path / "run")}, "task": {"target": "builtin:regression"},
                     "data": {"micro_batch_size": 8}, "accumulation": {"global_batch": 48},
                     "distributed": {"nproc_per_node": 1, "nnodes": "1:3"},
                     "checkpoint": {"on_world_change": "keep_global_batch"}})


def save(cfg, step, micro_batch=None, world=2, partial=False):
    root = store.checkpoint_root(cfg)
    os.makedirs(root, exist_ok=True)
    final = store.step_dir(root, step, micro_batch)
    tmp = final + ".tmp"
    os.makedirs(tmp)
    with open(os.path.join(tmp, store.STATE), "wb") as f:
        f.write(b"abc")
    store.commit(tmp, final, Manifest(step=step, epoch=0, micro_batch=step * 3, batches_per_epoch=18,
                                      world_size=world, micro_batch_size=8, config_hash=store.config_hash(cfg),
                                      config=store.training_config(cfg), reason="preempt" if partial else "step",
                                      partial_window=partial))
    return final


def test_a_group_of_another_size_passes_over_a_checkpoint_taken_inside_a_window(tmp_path):
    cfg = config(tmp_path)
    boundary = save(cfg, 4)
    inside = save(cfg, 5, micro_batch=17, partial=True)  # committed by the SIGTERM before the group re-formed
    assert store.list_checkpoints(store.checkpoint_root(cfg))[-1][1] == inside  # the newest
    same = plan_resume(cfg, 2, None, elastic=True)
    assert same.path == inside and same.notes == ()  # its own world size continues inside the window
    other = plan_resume(cfg, 3, None, elastic=True)
    assert other.path == boundary and other.scale == (1, 1)  # global_batch: the factor follows the world already
    assert other.notes == (f"elastic: passing over checkpoint {inside}: taken inside an accumulation window (or a "
                           f"stream's epoch) by 2 workers, this group has 3",)
    assert not usable_on(other.manifest.__class__(**{**vars(other.manifest), "partial_window": True}), 3)


def test_a_group_with_only_a_checkpoint_inside_the_first_window_starts_afresh(tmp_path):
    cfg = config(tmp_path)
    inside = save(cfg, 0, micro_batch=1, world=1, partial=True)
    plan = plan_resume(cfg, 2, None, elastic=True)
    assert plan.path is None and not plan.fresh  # nothing trained to lose; the folder is not moved aside
    assert inside in plan.notes[0]


def test_an_elastic_group_continues_even_without_a_restart_count(tmp_path):
    # a group re-formed for a node that joined: torchrun restarts no counter, the group still continues
    cfg = config(tmp_path)
    newest = save(cfg, 6, world=3)
    assert plan_resume(cfg, 3, None).path is None  # a plain first start: afresh
    assert plan_resume(cfg, 3, None, elastic=True).path == newest
    assert plan_resume(cfg, 2, None, elastic=True).path == newest  # a window boundary: any world size
