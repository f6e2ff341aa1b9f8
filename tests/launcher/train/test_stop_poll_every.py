"""`distributed.stop_poll_every` and `distributed.stop_poll_min_ms` (default 100) reach the engine the launcher's
trainer builds: its stop poll communicates every N micro-batches and no more often than once per that many ms (what
that does to where a stop lands is tests/accum_sched/test_stop_poll.py's, on 2 gloo ranks)."""
from __future__ import annotations

import os

import torch

import paths
from launcher.config import load_config
from launcher.train.trainer import Trainer

DEMO = os.path.join(str(paths.ROOT_PATH), "configs", "demo.yaml")


def test_the_trainers_engine_polls_every_n_micro_batches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value, every, floor in ((None, 1, 100.0), ("3", 3, 0.0)):
        sets = [f"run.output_dir={tmp_path / str(every)}", "distributed.nproc_per_node=1"]
        sets += [] if value is None else [f"distributed.stop_poll_every={value}", "distributed.stop_poll_min_ms=0"]
        engine = Trainer(load_config(DEMO, sets), torch.device("cpu")).engine
        assert engine.stop_at == "micro_batch"  # as `accum-sched run` builds it
        assert (engine._stop_poll.every, engine._stop_poll.min_ms) == (every, floor)
        assert engine.counters()["stop_poll_every"] == 1  # one process reads the flag at every micro-batch
