"""Costs that grow with what remains, not with what was done (issue: O(1) resume, one-pass planning, preemption
within a micro-batch):

- the engine stops inside a window at about one micro-batch after a stop request (on one rank only), every rank at
  the same micro-batch; its per-rank state_dict holds the open window; a fresh engine resumed from it with a
  positioned loader (skip=False) ends with the parameters of the uninterrupted run and of the large-batch reference
  (single process and 2-rank DDP);
- token-keyed planning loads every sample once (not epochs x world times) and gives the totals the old
  collate-every-shard method gave;
- `accum-sched run` gets SIGTERM 1 s into a 6.4 s window: it forwards it, the workers commit a checkpoint holding
  the open window within about 4 s and exit with the documented status; the resume (with 2 DataLoader workers) loads
  only what remains and ends equal to the uninterrupted run.
"""
from __future__ import annotations

import copy
import os
import sys

import torch

import paths

TESTS = paths.TESTS
sys.path.insert(0, TESTS)
import pytest

from cases import Case, loss_fn_for, make_model, make_optimizer, params, rank_batches, reference, run_engine  # noqa: E402
from distributed import attempt, spawn  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

CASE = Case("stop-mid-window", {0: 3, 1: 5}, epochs=3, samples=(40, 40), optimizer="adamw")  # 10 micro-batches
STOP_EPOCH, STOP_AT = 1, 2  # request during micro-batch 2 of epoch 1 (inside its first window of 5)


def interrupted_then_resumed(rank, world, requesting_rank=0, skip=False, micro_batch_size=None):
    """Train CASE, stop on a request (made on one rank), save, resume in a fresh engine; return what happened."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    def build():
        model = make_model(CASE)
        wrapped = DDP(model) if world > 1 else model
        optimizer = make_optimizer(CASE, model)
        return model, optimizer, AccumulationEngine(wrapped, optimizer, CASE.schedule, stop_at="micro_batch",
                                                    micro_batch_size=micro_batch_size)

    loss_fn = loss_fn_for(CASE.kind)
    model, optimizer, engine = build()
    for epoch in range(CASE.epochs):
        for i, batch in enumerate(engine.micro_batches(rank_batches(CASE, rank, epoch), epoch)):
            if (epoch, i) == (STOP_EPOCH, STOP_AT) and rank == requesting_rank:
                engine.request_stop()
            engine.backward(*loss_fn(engine.model, batch))
        if engine.should_stop:
            break
    stopped = {"epoch": engine.epoch_index, "micro": engine.micro_in_epoch, "open": engine.window_open,
               "steps": engine.optimizer_steps}
    saved = copy.deepcopy({"engine": engine.state_dict(), "model": model.state_dict(),
                           "optimizer": optimizer.state_dict()})
    del engine
    model, optimizer, engine = build()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    engine.load_state_dict(saved["engine"])
    for epoch in range(engine.epoch_index, CASE.epochs):
        batches = rank_batches(CASE, rank, epoch)
        loader = batches if skip else batches[engine.resume_offset(epoch):]
        engine.train_epoch(loader, loss_fn, epoch, skip=skip)
    return stopped, params(model), engine.optimizer_steps


def check_stop_and_resume(rank, world, results):
    outcome = attempt(lambda: interrupted_then_resumed(rank, world, requesting_rank=world - 1))
    outcome["plain"] = params(run_engine(CASE, rank, world)[0])
    results[rank] = outcome


def assert_resumed_equal(stopped, resumed, steps, plain, world):
    # requested during micro-batch 2, read after micro-batch 3's backward in DDP (one micro-batch later) or at
    # once in one process; epoch 1 begins with a window of 5, so both stop inside it, after step 4 (epoch 0: 10/3)
    assert stopped == {"epoch": 1, "micro": STOP_AT + (2 if world > 1 else 1), "open": True, "steps": 4}
    assert steps == 4 + 2 + 2  # epochs 1 and 2: windows of 5
    for got, want in zip(resumed, plain):
        assert torch.equal(got, want)  # the same sums in the same order
    for got, want in zip(resumed, params(reference(CASE, world))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_engine_stops_inside_a_window_and_resumes_exactly_single_process():
    plain = params(run_engine(CASE, 0, 1)[0])
    for skip in (False, True):  # positioned loader, or the engine skipping (loads what it skips)
        stopped, resumed, steps = interrupted_then_resumed(0, 1, skip=skip)
        assert_resumed_equal(stopped, resumed, steps, plain, 1)


def test_engine_stops_inside_a_window_and_resumes_exactly_ddp():
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        spawn(check_stop_and_resume, 2, results, deadline_s=240)
        results = dict(results)
    for rank in range(2):
        assert results[rank]["error"] is None, results[rank]["error"]
        stopped, resumed, steps = results[rank]["result"]
        assert_resumed_equal(stopped, resumed, steps, results[rank]["plain"], 2)


# -- planning: one pass -----------------------------------------------------------------------------------------
def test_token_planning_loads_every_sample_once_and_matches_collating_every_shard():
    from torch.utils.data import DistributedSampler

    from accum_sched import AccumulationSchedule
    from launcher.tasks import Task
    from launcher.tasks.builtin import charlm
    from launcher.train import plan

    made = charlm()
    data = made["dataset"]
    loaded = []

    class Recording(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            loaded.append(i)
            return data[i]

    world, micro, epochs = 2, 8, 3
    batches = -(-len(data) // world // micro)
    for length_fn in (made["length_fn"], None):  # the task's length_fn, or count_fn of one-sample batches
        task = Task(model=None, dataset=Recording(), loss_fn=None, collate_fn=made["collate_fn"],
                    count_fn=made["count_fn"], length_fn=length_fn)
        loaded.clear()
        per_step = plan.micro_step_counts(plan.sample_counts(task), task.dataset, epochs, world, micro, batches,
                                          True, 5)
        assert sorted(loaded) == list(range(len(data)))  # every sample once (ranks would split this pass)
        brute = {}  # the old way: collate every shard of every epoch (epochs x world loads of the dataset)
        for epoch in range(epochs):
            brute[epoch] = [0] * batches
            for rank in range(world):
                shard = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
                shard.set_epoch(epoch)
                idx = list(shard)
                for i in range(batches):
                    batch = made["collate_fn"]([data[j] for j in idx[i * micro:(i + 1) * micro]])
                    brute[epoch][i] += made["count_fn"](batch)
        assert per_step == brute
    schedule = AccumulationSchedule({0: 1, 3000: 2, 9000: 4}, "tokens")
    assert schedule.optimizer_steps(batches, epochs, tokens_per_micro_step=lambda e, i: per_step[e][i]) > 0


def test_resume_sampler_loads_only_what_remains_with_dataloader_workers():
    import tempfile

    from torch.utils.data import DataLoader, DistributedSampler

    from accum_sched import ResumeSampler
    from scale_tasks import CountingDataset, loads
    with tempfile.TemporaryDirectory() as where:
        os.environ["LOADS_DIR"] = where
        try:
            data = CountingDataset(torch.arange(40.0)[:, None], torch.zeros(40, 1))
            inner = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
            inner.set_epoch(2)
            full = list(inner)
            resumable = ResumeSampler(inner)
            resumable.start_at(3 * 4)  # 3 micro-batches of 4 trained
            loader = DataLoader(data, batch_size=4, sampler=resumable, num_workers=2)
            got = [b[0][:, 0].long().tolist() for b in loader]
            assert len(loader) == 2 and got == [full[12:16], full[16:20]]
            assert sorted(loads(where, 0)) == sorted(full[12:])  # the workers loaded the rest, nothing before
        finally:
            del os.environ["LOADS_DIR"]


# -- `accum-sched run` stopped by SIGTERM inside a long window ----------------------------------------------------
RUN_CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 2}}
task: {{target: "scale_tasks:slow_regression"}}
data: {{micro_batch_size: 2, shuffle: true}}
accumulation: {{unit: tokens, schedule: {{0: 16, 64: 4}}}}
optimizer: {{name: adamw, lr: 0.01}}
lr_scheduler: {{name: cosine, warmup_steps: 1}}
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 1000, keep_last: 3}}
logging: {{progress: plain, tensorboard: "off"}}
"""
# 64 samples, 2 workers x 2: 16 micro-batches per rank per epoch. Epoch 1 is one window of 16 (9.6 s at 0.6 s a
# micro-batch); after 64 tokens (= samples) the factor is 4. Token-keyed with an LR schedule: planning counts them.


def launch(tmp, name, *args, env=None, wait=True):
    import subprocess

    path = os.path.join(tmp, f"{name}.yaml")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(RUN_CONFIG.format(out=os.path.join(tmp, name)))
    full = {k: v for k, v in os.environ.items() if k not in ("LOADS_DIR", "SLOW_S", "STARTED")}
    full["PYTHONPATH"] = os.path.dirname(TESTS) + os.pathsep + full.get("PYTHONPATH", "")
    full.update(env or {})
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", path, *args], cwd=TESTS, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=400)
    return proc.returncode, out


def test_sigterm_to_accum_sched_run_commits_the_open_window_and_resume_equals_uninterrupted(tmp_path):
    import glob
    import signal
    import time

    from scale_tasks import loads

    status, out = launch(tmp_path, "ref")
    assert status == 0, out[-4000:]
    ref = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)

    loads_a, started = tmp_path / "loads-a", tmp_path / "started"
    loads_a.mkdir()
    proc = launch(tmp_path, "run", env={"LOADS_DIR": str(loads_a), "SLOW_S": "0.6", "STARTED": str(started)},
                  wait=False)
    deadline = time.monotonic() + 300
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.02)
    time.sleep(1.5)  # 1.5 s into the first window (16 micro-batches x 0.6 s)
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    pattern = str(tmp_path / "run" / "checkpoints" / "step-00000000-mb*")
    committed = None
    while proc.poll() is None:
        if committed is None and glob.glob(os.path.join(pattern, "manifest.json")):
            committed = time.monotonic() - signalled
        time.sleep(0.02)
    exited = time.monotonic() - signalled
    out = proc.communicate()[0]
    assert proc.returncode == 75, out[-4000:]  # documented: stopped by a signal with a checkpoint committed
    assert committed is not None and committed < 6.0, (committed, out[-3000:])  # before the window's end (8 s to go)
    assert exited < 12.0, exited  # measured ~2-4 s idle (torchrun's own shutdown follows the workers' exit)
    (ckpt,) = glob.glob(pattern)
    stop = int(ckpt.rsplit("mb", 1)[1])
    assert 2 <= stop <= 8, ckpt  # ~2.5 micro-batches in at the signal, +1 to agree: far from 16
    assert sorted(os.listdir(ckpt)) == ["manifest.json", "trainer.pt", "window-rank0.pt", "window-rank1.pt"]
    assert "inside a window, after micro-batch" in out

    # planning: every sample once over both ranks (32 each); training: exactly `stop` micro-batches per rank
    planning = {r: list(range(r, 64, 2)) for r in range(2)}
    for r in range(2):
        trained = sorted(loads(loads_a, r))
        for i in planning[r]:
            trained.remove(i)
        assert len(trained) == 2 * stop, r

    # the open window's gradients are per worker: another world size is refused before launch
    status, out = launch(tmp_path, "run", "--resume", "--nproc-per-node", "1", "--set",
                         "checkpoint.on_world_change=keep_factor")
    assert status == 2 and out.startswith("error: checkpoint.on_world_change: ") and "inside an accumulation window" \
        in out, out

    loads_b = tmp_path / "loads-b"
    loads_b.mkdir()
    # resumed with 2 DataLoader workers (not part of the config hash): ResumeSampler feeds them only what remains
    status, out = launch(tmp_path, "run", "--resume", "--set", "data.num_workers=2", env={"LOADS_DIR": str(loads_b)})
    assert status == 0, out[-4000:]
    assert f"micro-batch {stop} inside a window" in out
    for r in range(2):  # the resume loads the planning pass and what remains: 16 - stop, then all of epoch 2
        assert len(loads(loads_b, r)) == 32 + 2 * (16 - stop) + 32, r
    got = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    with open(tmp_path / "run" / "summary.json") as f, open(tmp_path / "ref" / "summary.json") as g:
        import json

        a, b = json.load(f), json.load(g)
    for key in ("optimizer_steps", "micro_batches", "samples", "elements", "final_loss"):
        assert a[key] == b[key], key
