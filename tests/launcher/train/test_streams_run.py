"""`accum-sched run` on streams (a task's IterableDataset), end to end with torchrun: every rank's parameters against
a plain-torch large-batch reference built in the test from the samples each rank's shard holds, the windows the
schedule gives (partial ones where a stream ends), step-, sample- and token-keyed schedules on an endless stream
ended by run.max_steps, exact mid-epoch resume after SIGKILL and SIGTERM (no trained sample read again by a stateful
stream), and resume on another world size refused before launch."""
from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from torch.utils.data import default_collate

import paths
import stream_tasks
from launcher.tasks.stream_lm import TokenStream

ROOT, TESTS = paths.ROOT, os.path.join(paths.ROOT, "tests")
MICRO = 3


def accum(*args, env=None, expect=0, timeout=300):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FAULT_", "RECORD_DIR"))}
    full["PYTHONPATH"] = ROOT + os.pathsep + TESTS + os.pathsep + full.get("PYTHONPATH", "")
    full.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=TESTS, env=full, capture_output=True,
                          text=True, timeout=timeout)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def write(tmp, name, body: str) -> str:
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(body.replace("OUT", os.path.join(tmp, name)))
    return path


def per_rank_params(record_dir, world):
    return [torch.load(os.path.join(record_dir, f"params-rank{r}.pt"), weights_only=True) for r in range(world)]


def assert_all_ranks_match(record_dir, world, reference, atol=1e-5):
    ranks = per_rank_params(record_dir, world)
    for r, params in enumerate(ranks):
        assert params.keys() == reference.keys()
        for k in params:
            torch.testing.assert_close(params[k], reference[k], atol=atol, rtol=0, msg=f"rank {r} {k}")


def summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def seed_all(seed=0):
    random.seed(seed)
    torch.manual_seed(seed)


def sgd_window(model, opt, batches, loss_of):
    """One optimizer step over ``batches`` (every rank's micro-batches of the window): summed loss / summed count."""
    opt.zero_grad()
    total, count = 0.0, 0
    for batch in batches:
        loss, n = loss_of(model, batch)
        total = total + loss
        count += int(n)
    (total / count).backward()
    opt.step()


# -- builtin:stream_lm: documents packed per rank's shard, epochs end at the shortest shard ---------------------
N_DOCS = 63  # per epoch: 19 micro-batches per rank at 2 ranks (short last ones), 11 of 11, 13, 14 at 3


def write_docs(folder) -> str:
    rng = random.Random(3)
    path = os.path.join(folder, "docs.txt")
    with open(path, "w") as f:
        for _ in range(N_DOCS):
            f.write(" ".join(rng.choice(["ab", "cde", "f", "ghij", "kl"]) for _ in range(rng.randint(1, 12))) + "\n")
    return path


LM_ARGS = "{files: [DOCS], seq_len: 12, d_model: 16, n_heads: 2, n_layers: 1}"
LM = """\
run: {output_dir: OUT, seed: 0, epochs: 2}
task: {target: stream_tasks:stream_lm, args: ARGS}
data: {micro_batch_size: 3}
accumulation: {schedule: {0: 2, 1: 3}}
optimizer: {name: sgd, lr: 0.2}
lr_scheduler: null
distributed: {nproc_per_node: NPROC}
logging: {progress: none}
"""


def lm_reference(docs, world, epochs=2, schedule=((0, 2), (1, 3))):
    seed_all(0)
    task = stream_tasks.builtin_stream_lm.stream_lm(files=[docs], seq_len=12, d_model=16, n_heads=2, n_layers=1)
    model = task["model"]
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    shards = []
    for r in range(world):
        samples = list(TokenStream([docs], seq_len=12).shard(world, r))
        shards.append([default_collate(samples[i:i + MICRO]) for i in range(0, len(samples), MICRO)])
    n = min(len(s) for s in shards)  # uneven shards: the epoch ends at the shortest (uneven: truncate)
    steps = 0
    for epoch in range(epochs):
        factor = [f for k, f in schedule if k <= epoch][-1]
        for start in range(0, n, factor):
            sgd_window(model, opt, [b for s in shards for b in s[start:min(start + factor, n)]],
                       stream_tasks.builtin_stream_lm.loss_fn)
            steps += 1
    return model.state_dict(), n, steps


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_stream_lm_matches_the_large_batch_reference_on_every_rank(tmp_path, world):
    docs = write_docs(tmp_path)
    body = LM.replace("ARGS", LM_ARGS.replace("DOCS", docs)).replace("NPROC", str(world))
    cfg = write(tmp_path, "run", body)
    accum("run", cfg, env={"RECORD_DIR": str(tmp_path / "rec")})
    reference, per_epoch, steps = lm_reference(docs, world)
    assert per_epoch % 2 and per_epoch % 3, per_epoch  # both factors leave a partial window at the epoch's end
    assert_all_ranks_match(tmp_path / "rec", world, reference)
    s = summary(tmp_path / "run")
    assert (s["optimizer_steps"], s["micro_batches"], s["completed_epochs"]) == (steps, 2 * per_epoch, 2)
    # every real target of the trained windows counted once: the packed samples' valid targets, no padding
    expected = 0
    for r in range(world):
        samples = list(TokenStream([docs], seq_len=12).shard(world, r))[: per_epoch * MICRO]
        expected += sum(int(v[1:].sum()) for _, v in samples)
    assert s["elements"] == 2 * expected


# -- an endless stream, schedules by step, samples and tokens, ended by run.max_steps ---------------------------
NUMBERS = """\
run: {output_dir: OUT, seed: 0, max_steps: 9}
task: {target: stream_tasks:numbers, args: ARGS}
data: {micro_batch_size: 3, num_workers: WORKERS}
accumulation: {unit: UNIT, schedule: SCHEDULE}
optimizer: {name: sgd, lr: 0.1}
lr_scheduler: null
distributed: {nproc_per_node: NPROC}
checkpoint: {every_n_steps: 2}
logging: {progress: none}
"""
SCHEDULES = {"step": {0: 1, 3: 2, 6: 3}, "samples": {0: 1, 24: 2, 60: 3}, "tokens": {0: 1, 60: 2, 150: 3}}


def numbers_config(tmp, name, *, unit="step", world=2, workers=0, args="{}", schedule=None):
    body = (NUMBERS.replace("ARGS", args).replace("UNIT", unit).replace("SCHEDULE", str(schedule or SCHEDULES[unit]))
            .replace("WORKERS", str(workers)).replace("NPROC", str(world)))
    return write(tmp, name, body)


def numbers_batches(rank, world, workers):
    """Rank ``rank``'s micro-batches in loader order: shard ``rank * workers + w`` of ``world * workers`` (every
    n-th sample), the loader taking one batch from each worker in turn."""
    nw = max(1, workers)
    n = world * nw
    j = 0
    while True:
        w, b = j % nw, j // nw
        shard = rank * nw + w
        yield default_collate([stream_tasks.sample(shard + n * (b * MICRO + t)) for t in range(MICRO)])
        j += 1


def numbers_reference(unit, world, workers, max_steps=9, schedule=None):
    seed_all(0)
    model = stream_tasks.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    milestones = schedule or SCHEDULES[unit]
    streams = [numbers_batches(r, world, workers) for r in range(world)]
    position = {"step": 0, "samples": 0, "tokens": 0}
    factors = []
    for _ in range(max_steps):
        factor = milestones[max(k for k in milestones if k <= position[unit])]  # Lightning's rule, by hand
        factors.append(factor)
        window = [next(s) for _ in range(factor) for s in streams]
        sgd_window(model, opt, window, stream_tasks.numbers_loss)
        position["step"] += 1
        position["samples"] += len(window) * MICRO
        position["tokens"] += sum(int(b[2].sum()) for b in window)
    return model.state_dict(), factors


@pytest.mark.parametrize("unit", ["step", "samples", "tokens"])
@pytest.mark.slow
def test_an_endless_stream_trains_to_max_steps_under_every_schedule_unit(tmp_path, unit):
    cfg = numbers_config(tmp_path, "run", unit=unit)
    accum("run", cfg, env={"RECORD_DIR": str(tmp_path / "rec")})
    reference, factors = numbers_reference(unit, 2, 0)
    assert len(set(factors)) == 3, factors  # the schedule changed factor twice within the 9 steps
    assert_all_ranks_match(tmp_path / "rec", 2, reference)
    s = summary(tmp_path / "run")
    assert (s["optimizer_steps"], s["stopped_early"], s["completed_epochs"]) == (9, False, 0)
    assert [m["factor"] for m in metrics(tmp_path / "run")] == factors


@pytest.mark.slow
def test_three_ranks_with_two_loader_workers_each_shard_by_rank_and_worker(tmp_path):
    cfg = numbers_config(tmp_path, "run", world=3, workers=2)
    accum("run", cfg, env={"RECORD_DIR": str(tmp_path / "rec")})
    reference, _ = numbers_reference("step", 3, 2)
    assert_all_ranks_match(tmp_path / "rec", 3, reference)


# -- resume mid-epoch on a stream -------------------------------------------------------------------------------
def reads(record_dir, rank):
    out = {}
    for path in glob.glob(os.path.join(record_dir, f"reads-rank{rank}-pid*.txt")):
        with open(path) as f:
            out[path] = [int(line) for line in f]
    return out


@pytest.fixture(scope="module")
def uninterrupted_numbers(tmp_path_factory):
    """The uninterrupted run of the numbers stream (the stateful kind): its directory. The sharded, stateful and
    plain kinds give every rank the same samples in the same order, so their uninterrupted runs are bit for bit the
    same (measured) and one serves all three."""
    tmp = tmp_path_factory.mktemp("numbers")
    accum("run", numbers_config(tmp, "ref", args="{}"), env={"RECORD_DIR": str(tmp / "ref-rec")})
    return tmp


@pytest.mark.parametrize("kind", ["sharded", "stateful", "plain"])
@pytest.mark.slow
def test_sigkill_mid_epoch_resumes_the_stream_exactly(tmp_path, uninterrupted_numbers, kind):
    """Rank 1 is SIGKILLed at its 11th micro-batch (steps 1-3 take 1 micro-batch, 4-6 take 2, 7 on 3: inside step
    7's window); torchrun restarts the group, which resumes from the step-6 checkpoint (micro-batch 9 of the epoch)
    with every rank's loader positioned by its own saved state, and ends bit for bit at the uninterrupted run."""
    args = {"sharded": "{shardable: true}", "stateful": "{}", "plain": "{stateful: false}"}[kind]
    cfg = numbers_config(tmp_path, "run", args=args)
    marker = tmp_path / "marker"
    fault = {"FAULT_MODE": "kill", "FAULT_RANK": "1", "FAULT_AT": "11", "FAULT_MARKER": str(marker)}
    proc = accum("run", cfg, "--max-restarts", "1", env={**fault, "RECORD_DIR": str(tmp_path / "rec")})
    assert marker.exists()
    text = proc.stdout + proc.stderr
    assert "resumed from " + os.path.join(tmp_path, "run", "checkpoints", "step-00000006") in text, text[-3000:]
    assert "(step 6, epoch 0, micro-batch 9;" in text
    # the checkpoints kept (keep_last: 2) are inside the endless epoch too: each rank's loader position in them
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000008"
    assert {"stream-rank0.pt", "stream-rank1.pt"} <= set(os.listdir(ckpt))
    with open(ckpt / "manifest.json") as f:
        assert json.load(f)["stream"] is True
    ref = uninterrupted_numbers
    for a, b in zip(per_rank_params(tmp_path / "rec", 2), per_rank_params(ref / "ref-rec", 2)):
        for k in a:
            assert torch.equal(a[k], b[k]), k  # bit for bit the uninterrupted run
    assert [m["loss"] for m in metrics(tmp_path / "run")] == [m["loss"] for m in metrics(ref / "ref")]
    if kind == "sharded":  # O(1): the restarted process reads nothing before the saved position
        # 9 micro-batches of 3 trained per rank: rank 0's shard holds samples 0, 2, 4, ...; the next is 2 * 27
        restarted = [r for r in reads(tmp_path / "rec", 0).values() if r and r[0] != 0]
        assert len(restarted) == 1 and restarted[0][0] == 2 * 9 * MICRO, restarted


@pytest.mark.slow
def test_sigterm_mid_epoch_stops_inside_the_window_and_resume_equals_uninterrupted(tmp_path):
    ref = numbers_config(tmp_path, "ref", args="{shardable: true}", schedule={0: 3})
    accum("run", ref, env={"RECORD_DIR": str(tmp_path / "ref-rec")})
    cfg = numbers_config(tmp_path, "run", args="{shardable: true}", schedule={0: 3})
    fault = {"FAULT_MODE": "term", "FAULT_RANK": "0", "FAULT_AT": "7", "FAULT_MARKER": str(tmp_path / "marker")}
    # no time floor on the poll (its micro-batches take well under its default 100 ms: it would stop at the boundary)
    stopped = accum("run", cfg, "--set", "distributed.stop_poll_min_ms=0", env=fault, expect=None)
    assert stopped.returncode in (0, 75), stopped.stdout[-3000:] + stopped.stderr[-3000:]
    # rank 0 signalled itself at its 7th micro-batch, the first of step 3's window: the stop is agreed inside it
    assert "preempted at step 2: checkpoint saved" in stopped.stdout and "inside a window" in stopped.stdout
    (ckpt,) = glob.glob(str(tmp_path / "run" / "checkpoints" / "step-00000002-mb*"))
    assert int(ckpt.rsplit("mb", 1)[1]) in (7, 8)
    assert {"stream-rank0.pt", "stream-rank1.pt", "window-rank0.pt", "window-rank1.pt"} <= set(os.listdir(ckpt))
    # the open window and the stream positions are per worker: another world size is refused before launch
    other = accum("run", cfg, "--resume", "--nproc-per-node", "3", "--set",
                  "checkpoint.on_world_change=keep_factor", expect=2)
    # on a machine with fewer than 3 cores the oversubscription warning (issue 37) comes first; then one error line
    lines = [line for line in other.stderr.splitlines()
             if not line.startswith("warning: distributed.nproc_per_node is 3 but this machine has")]
    assert lines[0].startswith("error: checkpoint.on_world_change: ") and len(lines) == 1, other.stderr
    accum("run", cfg, "--resume", env={"RECORD_DIR": str(tmp_path / "rec")})
    for a, b in zip(per_rank_params(tmp_path / "rec", 2), per_rank_params(tmp_path / "ref-rec", 2)):
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_a_stream_checkpoint_at_a_step_is_refused_on_another_world_size(tmp_path):
    cfg = numbers_config(tmp_path, "run", args="{shardable: true}")
    accum("run", cfg)
    proc = accum("run", cfg, "--resume", "--nproc-per-node", "1", "--set", "checkpoint.on_world_change=keep_factor",
                 expect=2)
    assert proc.stderr.startswith("error: checkpoint.on_world_change: ") and "stream" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_decaying_lr_schedule_on_a_stream_needs_max_steps(tmp_path):
    body = NUMBERS.replace("max_steps: 9", "max_steps: null").replace("lr_scheduler: null",
                                                                       "lr_scheduler: {name: cosine}")
    body = body.replace("ARGS", "{length: 30}").replace("UNIT", "step").replace("SCHEDULE", "2")
    body = body.replace("WORKERS", "0").replace("NPROC", "1")
    proc = accum("run", write(tmp_path, "run", body), expect=None)
    assert proc.returncode != 0
    assert "run.max_steps: is null, but the task's dataset is a stream" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_finite_stream_with_validation_stream(tmp_path):
    """Two epochs over 40 samples (20 per rank, 7 micro-batches of 3, the last short) and a validation stream of
    11 samples (6 on rank 0, 5 on rank 1): the exact mean over all 11 on both ranks."""
    body = NUMBERS.replace("max_steps: 9", "max_steps: null, epochs: 2").replace(
        "ARGS", "{length: 40, val_length: 11}").replace("UNIT", "epoch").replace("SCHEDULE", "{0: 2, 1: 4}")
    cfg = write(tmp_path, "run", body.replace("WORKERS", "0").replace("NPROC", "2"))
    accum("run", cfg, env={"RECORD_DIR": str(tmp_path / "rec")})
    seed_all(0)
    model = stream_tasks.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shards = [[default_collate([stream_tasks.sample(k) for k in range(r, 40, 2)][i:i + MICRO])
               for i in range(0, 20, MICRO)] for r in range(2)]
    for factor in (2, 4):
        for start in range(0, 7, factor):
            sgd_window(model, opt, [b for s in shards for b in s[start:start + factor]], stream_tasks.numbers_loss)
    assert_all_ranks_match(tmp_path / "rec", 2, model.state_dict())
    with torch.no_grad():
        x, y, mask = default_collate([stream_tasks.sample(k) for k in range(11)])
        loss = ((((model(x) - y) ** 2).mean(-1)) * mask).sum() / mask.sum()
    with open(tmp_path / "run" / "eval.jsonl") as f:
        last = [json.loads(line) for line in f][-1]
    assert last["val_elements"] == int(mask.sum())
    assert abs(last["val_loss"] - float(loss)) < 1e-6


@pytest.mark.slow
def test_an_endless_stream_under_fsdp2_matches_the_reference(tmp_path):
    """FSDP2 over a stream: model.pt is gathered from both ranks' shards, so it checks every rank's part."""
    body = NUMBERS.replace("distributed: {nproc_per_node: NPROC}", "distributed: {nproc_per_node: 2, backend: fsdp}")
    body = (body.replace("ARGS", "{shardable: true}").replace("UNIT", "samples").replace("WORKERS", "0")
            .replace("SCHEDULE", str(SCHEDULES["samples"])))
    accum("run", write(tmp_path, "run", body))
    reference, _ = numbers_reference("samples", 2, 0)
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert model.keys() == reference.keys()
    for k in model:
        torch.testing.assert_close(model[k], reference[k], atol=1e-5, rtol=0, msg=k)


@pytest.mark.slow
def test_data_shard_none_leaves_the_sharding_to_the_task(tmp_path):
    """builtin:stream_lm cutting its own stream by rank (shard_by_rank, data.shard: none) trains what the
    launcher's auto sharding trains; data.shard: none with a stream the task does not shard gives every rank the
    whole stream (a reference with both ranks reading all documents)."""
    docs = write_docs(tmp_path)
    auto = LM.replace("ARGS", LM_ARGS.replace("DOCS", docs)).replace("NPROC", "2")
    accum("run", write(tmp_path, "auto", auto), env={"RECORD_DIR": str(tmp_path / "rec-auto")})
    own = LM.replace("ARGS", LM_ARGS.replace("DOCS", docs).replace("}", ", shard_by_rank: true}"))
    own = own.replace("NPROC", "2").replace("data: {micro_batch_size: 3}", "data: {micro_batch_size: 3, shard: none}")
    accum("run", write(tmp_path, "own", own), env={"RECORD_DIR": str(tmp_path / "rec-own")})
    for a, b in zip(per_rank_params(tmp_path / "rec-own", 2), per_rank_params(tmp_path / "rec-auto", 2)):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    whole = own.replace(", shard_by_rank: true", "")
    accum("run", write(tmp_path, "whole", whole), env={"RECORD_DIR": str(tmp_path / "rec-whole")})
    seed_all(0)  # each rank reads every document: every window holds each micro-batch twice
    task = stream_tasks.builtin_stream_lm.stream_lm(files=[docs], seq_len=12, d_model=16, n_heads=2, n_layers=1)
    model = task["model"]
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    samples = list(TokenStream([docs], seq_len=12))
    batches = [default_collate(samples[i:i + MICRO]) for i in range(0, len(samples), MICRO)]
    for factor in (2, 3):
        for start in range(0, len(batches), factor):
            window = batches[start:start + factor]
            sgd_window(model, opt, window + window, stream_tasks.builtin_stream_lm.loss_fn)
    assert_all_ranks_match(tmp_path / "rec-whole", 2, model.state_dict())


@pytest.mark.slow
def test_an_endless_stream_under_deepspeed_zero2_matches_the_reference(tmp_path):
    """DeepSpeed ZeRO-2 driven to the stream's windows (its boundaries are the engine's): model.pt (gathered from
    the ranks' partitions) against the reference, with a sample-keyed schedule changing factor twice."""
    ds = os.path.join(ROOT, "configs", "ds_zero2.json")
    body = NUMBERS.replace("distributed: {nproc_per_node: NPROC}",
                           f"distributed: {{nproc_per_node: 2, backend: deepspeed, deepspeed_config: {ds}}}")
    body = (body.replace("ARGS", "{shardable: true}").replace("UNIT", "samples").replace("WORKERS", "0")
            .replace("SCHEDULE", str(SCHEDULES["samples"])))
    accum("run", write(tmp_path, "run", body), timeout=600)
    reference, factors = numbers_reference("samples", 2, 0)
    assert [m["factor"] for m in metrics(tmp_path / "run")] == factors
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for k in reference:
        torch.testing.assert_close(model[k], reference[k], atol=1e-5, rtol=0, msg=k)
