"""Experiment: fixed accumulation factors 1, 4, 16 against the adaptive factor on builtin:charlm (docs/adaptive.md).

    python bench/adaptive.py                       # 2 gloo ranks, a few minutes on 2 busy cores
    python bench/adaptive.py --target 2.4 --max-epochs 60 --out runs/bench-adaptive

Every run trains the same model from the same initial weights with the same optimizer and learning rate (AdamW,
3e-3, no LR coupling) on the same training split: every 5th sample of the corpus is held out for validation. After
every optimizer step each rank computes the validation loss (mean per token over the held-out split; identical on
every rank, so all stop at the same step) and the run stops once it is at or below ``--target``. Reported per run:
optimizer steps, samples and tokens (all ranks) to reach the target, training seconds to it (the validation passes
are timed separately and left out), the best validation loss, and for the adaptive run the factors it chose.

Each run is its own set of processes (torch.multiprocessing spawn, gloo, file store), so no run inherits another's
caches. Not a test: it asserts nothing; it prints a table and writes OUT/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

RUNS = {"fixed 1": 1, "fixed 4": 4, "fixed 16": 16, "adaptive": "adaptive"}


class Reached(Exception):
    """Raised from the on_step callback (on every rank at the same step) once the target is reached."""


def _split(dataset):
    val = [i for i in range(len(dataset)) if i % 5 == 4]
    train = [i for i in range(len(dataset)) if i % 5 != 4]
    return train, val


def _worker(rank: int, world: int, store: str, args, name: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    from accum_sched import AccumulationEngine
    from launcher.tasks.builtin import charlm, pad_batch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    task = charlm(max_len=64, d_model=64, n_heads=4, n_layers=2)
    train_idx, val_idx = _split(task["dataset"])
    train = Subset(task["dataset"], train_idx)
    val_batch = pad_batch([task["dataset"][i] for i in val_idx])
    model, loss_fn = task["model"], task["loss_fn"]
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.micro, sampler=sampler, collate_fn=pad_batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    spec = RUNS[name]
    if spec == "adaptive":
        adaptive = {"min_factor": 1, "max_factor": 16, "every_n_steps": args.every, "ema": args.ema}
        engine = AccumulationEngine(DDP(model), optimizer, adaptive=adaptive, micro_batch_size=args.micro,
                                    max_grad_norm=1.0)
    else:
        engine = AccumulationEngine(DDP(model), optimizer, spec, micro_batch_size=args.micro, max_grad_norm=1.0,
                                    noise_scale=True)
    record = {"steps": [], "val": [], "factor": [], "noise_scale": [], "samples": 0, "tokens": 0,
              "eval_seconds": 0.0, "reached": None}

    def on_step(info):
        began = time.perf_counter()
        with torch.no_grad():
            model.eval()
            total, count = loss_fn(model, val_batch)
            model.train()
        val = float(total) / float(count)
        record["eval_seconds"] += time.perf_counter() - began
        record["samples"] += info.samples
        record["tokens"] += info.elements
        record["steps"].append(info.step)
        record["val"].append(val)
        record["factor"].append(info.factor)
        record["noise_scale"].append(info.noise["noise_scale"] if info.noise else None)
        if val <= args.target:
            record["reached"] = {"step": info.step, "samples": record["samples"], "tokens": record["tokens"],
                                 "epoch": info.epoch}
            raise Reached

    engine.on_step(on_step)
    start = time.perf_counter()
    try:
        for epoch in range(args.max_epochs):
            sampler.set_epoch(epoch)
            engine.train_epoch(loader, loss_fn, epoch)
    except Reached:
        pass
    record["seconds"] = time.perf_counter() - start - record["eval_seconds"]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(record, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see tests/distributed.py: no gloo teardown during interpreter finalization


def run_one(args, name: str, out_dir: str) -> dict:
    import torch.multiprocessing as mp

    out = os.path.join(out_dir, name.replace(" ", "_") + ".json")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.world, os.path.join(tmp, "store"), args, name, out),
                           nprocs=args.world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def summarize(name: str, rec: dict) -> dict:
    reached = rec["reached"] or {}
    factors = sorted(set(rec["factor"]))
    return {"run": name, "reached": bool(reached), "steps": reached.get("step"), "samples": reached.get("samples"),
            "tokens": reached.get("tokens"), "train_seconds": round(rec["seconds"], 2),
            "best_val": round(min(rec["val"]), 4), "steps_run": len(rec["steps"]),
            "factors": factors if len(factors) > 1 else factors[0],
            "noise_scale_last": rec["noise_scale"][-1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=2.4, help="validation loss (nats per token) to reach")
    parser.add_argument("--max-epochs", type=int, default=60)
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--every", type=int, default=5, help="adaptive every_n_steps")
    parser.add_argument("--ema", type=float, default=0.9, help="adaptive ema")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of: " + ", ".join(RUNS))
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-adaptive"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows, records = [], {}
    for name in [n.strip() for n in args.runs.split(",")]:
        began = time.time()
        records[name] = run_one(args, name, args.out)
        rows.append(summarize(name, records[name]))
        print(f"{name}: {rows[-1]} ({time.time() - began:.0f} s with start-up)", flush=True)
    print(f"\ntarget validation loss {args.target} (world {args.world}, micro-batch {args.micro})")
    print(f"{'run':<10} {'reached':>7} {'steps':>6} {'samples':>8} {'tokens':>8} {'train s':>8} "
          f"{'best val':>9}  factors")
    for r in rows:
        print(f"{r['run']:<10} {str(r['reached']):>7} {str(r['steps']):>6} {str(r['samples']):>8} "
              f"{str(r['tokens']):>8} {r['train_seconds']:>8} {r['best_val']:>9}  {r['factors']}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
