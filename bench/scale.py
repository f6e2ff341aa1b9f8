"""Costs that must grow with what remains to do, not with what was done (docs/resume.md, "Scale"):

1. resume: seconds from making the epoch's loader to its first micro-batch, resuming at 0..95% of an epoch, by
   replaying (iterate and drop, as the engine's skip=True does) and by ResumeSampler (the launcher's way), with
   DataLoader workers 0 and 2; samples cost ``--load-ms`` each to load (a stand-in for decoding);
2. planning a token-keyed run's step total: one shared pass + indices (launcher/train/plan.py) vs collating every shard
   of every epoch (the old way), by dataset size;
3. signal -> committed checkpoint: `accum-sched run` (2 gloo workers, micro-batches of ``--micro-s``) gets SIGTERM
   1 s into its first window; by accumulation factor, next to when that window would have ended;
4. checkpoint write (hashed while written) and verify (one read) throughput, by size;
5. what the per-micro-batch stop poll costs: seconds per micro-batch of a 2-rank DDP loop at factor 8, with
   the poll off and on, alternating epoch by epoch in one engine (medians).

    PYTHONPATH=. python bench/scale.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from accum_sched import AccumulationSchedule, ResumeSampler  # noqa: E402
from launcher.checkpoint import store  # noqa: E402
from launcher.tasks import Task  # noqa: E402
from launcher.train import plan  # noqa: E402


class SlowDataset(Dataset):
    """Sample i: a token sequence of length 1 + i*7 % 48, costing ``load_s`` to load."""

    def __init__(self, n: int, load_s: float):
        self.n, self.load_s = n, load_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.load_s:
            end = time.perf_counter() + self.load_s
            while time.perf_counter() < end:  # busy: sleep() is too coarse at 0.1 ms
                pass
        return torch.arange(1 + (i * 7) % 48)


def pad(batch):
    return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True)


def count(batch):
    return int((batch != 0).sum()) + batch.shape[0]  # arange starts at 0: count the first token too


# -- 1. resume ---------------------------------------------------------------------------------------------------
def resume_rows(n: int, micro: int, load_s: float, workers_list) -> list[dict]:
    rows = []
    data = SlowDataset(n, load_s)
    batches = n // micro
    for workers in workers_list:
        for share in (0.0, 0.25, 0.5, 0.75, 0.95):
            skip = int(batches * share)
            row = {"workers": workers, "position": share, "skipped_micro_batches": skip}
            for how in ("replay", "sampler"):
                sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
                resumable = ResumeSampler(sampler)
                resumable.start_at(skip * micro if how == "sampler" else 0)
                loader = DataLoader(data, batch_size=micro, sampler=resumable, num_workers=workers, collate_fn=pad)
                began = time.perf_counter()
                it = iter(loader)
                for _ in range(skip if how == "replay" else 0):
                    next(it)
                next(it)
                row[f"{how}_s"] = round(time.perf_counter() - began, 4)
                del it
            rows.append(row)
    return rows


# -- 2. planning -------------------------------------------------------------------------------------------------
def old_planning(task, epochs, world, micro, batches):
    """What plan_total_steps did before: collate every shard of every epoch (on every rank)."""
    counts = {}
    for epoch in range(epochs):
        per_step = [0] * batches
        for rank in range(world):
            shard = DistributedSampler(task.dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
            shard.set_epoch(epoch)
            idx = list(shard)
            for i in range(batches):
                per_step[i] += count(pad([task.dataset[j] for j in idx[i * micro:(i + 1) * micro]]))
        counts[epoch] = per_step
    return counts


def planning_rows(sizes, load_s: float, epochs: int, world: int, micro: int, old_up_to: int) -> list[dict]:
    rows = []
    schedule = AccumulationSchedule({0: 1, 10_000: 2, 100_000: 4}, "tokens")
    for n in sizes:
        task = Task(model=None, dataset=SlowDataset(n, load_s), loss_fn=None, collate_fn=pad, count_fn=count)
        batches = -(-n // world // micro)
        began = time.perf_counter()
        counts = plan.sample_counts(task)  # one process: the whole pass (world ranks would split it)
        per_step = plan.micro_step_counts(counts, task.dataset, epochs, world, micro, batches, True, 0)
        steps = schedule.optimizer_steps(batches, epochs, tokens_per_micro_step=lambda e, i: per_step[e][i])
        row = {"samples": n, "new_s": round(time.perf_counter() - began, 3), "steps": steps,
               "new_loads": n, "old_loads_per_rank": epochs * n}
        if n <= old_up_to:
            began = time.perf_counter()
            old = old_planning(task, epochs, world, micro, batches)
            row["old_s"] = round(time.perf_counter() - began, 3)
            assert old == per_step, "planning changed its answer"
        rows.append(row)
    return rows


# -- 3. signal -> checkpoint -------------------------------------------------------------------------------------
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 1}}
task: {{target: "scale_tasks:slow_regression", args: {{samples: {samples}}}}}
data: {{micro_batch_size: 2, shuffle: true}}
accumulation: {{schedule: {{0: {factor}}}}}
optimizer: {{name: adamw, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
checkpoint: {{every_n_steps: 1000}}
logging: {{progress: plain, tensorboard: "off"}}
"""


def signal_row(tmp: str, factor: int, micro_s: float) -> dict:
    out = os.path.join(tmp, f"f{factor}")
    cfg = out + ".yaml"
    with open(cfg, "w") as f:
        f.write(CONFIG.format(out=out, samples=256, factor=factor))  # 64 micro-batches per rank: >= one window
    started = out + ".started"
    env = dict(os.environ, SLOW_S=str(micro_s), STARTED=started,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", cfg], cwd=os.path.join(ROOT, "tests"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not os.path.exists(started):
        if proc.poll() is not None:
            raise RuntimeError(proc.communicate()[0][-3000:])
        time.sleep(0.01)
    began = time.monotonic()
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    committed = None
    pattern = os.path.join(out, "checkpoints", "step-*", "manifest.json")
    while proc.poll() is None:
        if committed is None and glob.glob(pattern):
            committed = time.monotonic() - sent
        time.sleep(0.01)
    exited = time.monotonic() - sent
    text = proc.communicate()[0]
    if committed is None and glob.glob(pattern):
        committed = exited
    names = [os.path.basename(os.path.dirname(p)) for p in glob.glob(pattern)]
    return {"factor": factor, "micro_batch_s": micro_s, "window_s": round(factor * micro_s, 2),
            "window_end_after_signal_s": round(factor * micro_s - (sent - began) % (factor * micro_s), 2),
            "signal_to_commit_s": None if committed is None else round(committed, 2), "exit_s": round(exited, 2),
            "status": proc.returncode, "checkpoint": names, "tail": "" if names else text[-1500:]}


# -- 4. checkpoint I/O -------------------------------------------------------------------------------------------
def io_rows(tmp: str, sizes_mib) -> list[dict]:
    rows = []
    for mib in sizes_mib:
        state = {"w": torch.randn(mib * (1 << 20) // 4)}
        d = os.path.join(tmp, f"io-{mib}")
        os.makedirs(d)
        began = time.perf_counter()
        with store.HashingFile(os.path.join(d, "trainer.pt")) as f:
            torch.save(state, f)
        store.commit(d, d + "-done", {"format": store.FORMAT}, {"trainer.pt": f.entry})
        write_s = time.perf_counter() - began
        began = time.perf_counter()  # the old way: write, then read everything back to hash it
        path = os.path.join(tmp, f"old-{mib}.pt")
        with open(path, "wb") as g:
            torch.save(state, g)
            g.flush()
            os.fsync(g.fileno())
        store.file_digest(path)
        old_s = time.perf_counter() - began
        began = time.perf_counter()
        manifest, problem = store.verify(d + "-done")
        verify_s = time.perf_counter() - began
        assert problem is None, problem
        rows.append({"mib": mib, "write_hashed_s": round(write_s, 3), "write_then_hash_s": round(old_s, 3),
                     "verify_s": round(verify_s, 3), "write_mib_s": round(mib / write_s),
                     "verify_mib_s": round(mib / verify_s)})
        shutil.rmtree(d + "-done")
        os.remove(path)
    return rows


# -- 5. the stop poll's cost -------------------------------------------------------------------------------------
def _poll_rank(rank: int, world: int, init: str, micro_batches: int, repeats: int, out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    batches = [(torch.randn(16, 256), torch.randn(16, 256)) for _ in range(micro_batches)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))
    ddp = DDP(model)
    engine = AccumulationEngine(ddp, torch.optim.SGD(model.parameters(), lr=0.01), 8, stop_at="micro_batch")
    poll = engine._stop_poll
    times = {"boundary": [], "micro_batch": []}
    waited = [0.0, 0]  # seconds inside the poll (waiting for the previous sum, starting the next), polls
    poll_once = poll.poll

    def timed_poll(requested):
        began = time.perf_counter()
        try:
            return poll_once(requested)
        finally:
            waited[0] += time.perf_counter() - began
            waited[1] += 1

    poll.poll = timed_poll
    # One engine, the poll switched on and off epoch by epoch (fine interleaving: load drift hits both alike).
    for epoch in range(1 + 2 * repeats):
        mode = "micro_batch" if epoch % 2 else "boundary"
        engine._stop_poll = poll if mode == "micro_batch" else None
        dist.barrier()
        began = time.perf_counter()
        for x, y in engine.micro_batches(batches, epoch):
            engine.backward(((ddp(x) - y) ** 2).sum(), x.shape[0])
        if epoch:  # epoch 0 warms up
            times[mode].append((time.perf_counter() - began) / micro_batches)
    if rank == 0:
        out.put(dict({k: sorted(v)[len(v) // 2] for k, v in times.items()}, poll_s=waited[0] / max(waited[1], 1)))
    dist.barrier()
    os._exit(0)


def poll_rows(tmp: str, micro_batches: int = 32, repeats: int = 40) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_poll_rank, args=(r, 2, os.path.join(tmp, "poll-store"), micro_batches, repeats, out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=600)
    for p in procs:
        p.join()
    b, m = got["boundary"], got["micro_batch"]
    return [{"ranks": 2, "factor": 8, "micro_batches": micro_batches, "boundary_ms": round(b * 1e3, 3),
             "micro_batch_ms": round(m * 1e3, 3), "ratio": round(m / b, 3),
             "inside_poll_us": round(got["poll_s"] * 1e6, 1)}]


def table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k != "tail"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (CI smoke)")
    ap.add_argument("--load-ms", type=float, default=1.0, help="cost of loading one sample (resume, planning)")
    ap.add_argument("--micro-s", type=float, default=0.1, help="seconds per micro-batch in the signal test")
    ap.add_argument("--only", default="resume,planning,signal,io,poll")
    ap.add_argument("--planning-old-up-to", type=int, default=None, help="largest size to plan the old way too")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    only = set(args.only.split(","))
    load_s = args.load_ms / 1000
    results = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        if "resume" in only:
            results["resume"] = resume_rows(1000 if args.quick else 2000, 8, load_s, (0, 2))
        if "planning" in only:
            sizes = (1000, 4000) if args.quick else (1000, 4000, 16000, 64000)
            old_up_to = args.planning_old_up_to or (4000 if args.quick else 16000)
            results["planning"] = planning_rows(sizes, load_s / 10, 3, 2, 8, old_up_to=old_up_to)
        if "signal" in only:
            factors = (4, 16) if args.quick else (4, 16, 64)
            results["signal"] = [signal_row(tmp, f, args.micro_s) for f in factors]
        if "poll" in only:
            results["poll"] = poll_rows(tmp, 32, 10 if args.quick else 40)
        if "io" in only:
            results["io"] = io_rows(tmp, (16, 64) if args.quick else (16, 64, 256, 1024))
    for name, rows in results.items():
        if name != "machine":
            print(f"\n## {name}\n\n{table(rows)}")
    print(f"\nmachine: {results['machine']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
