"""Memory per rank under each back end: DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, on 1, 2 and 4 ranks.

    PYTHONPATH=. python bench/memory.py [--backends ddp,fsdp,zero2,zero3] [--worlds 1,2,4] [--json out.json]

Each row is one real training run through the launcher's worker path (launcher/worker.py's join, then
launcher/train/trainer.py's Trainer and fit(): the back end's setup, the engine, an epoch-end checkpoint, model.pt)
started by torchrun on gloo, one thread per rank: the benchmark's 20.7M-parameter MLP (bench/workload.py, 256 ->
4 x 2240 -> 16; under FSDP2 every Linear sharded, then the root), AdamW, 4 micro-batches of 8 per rank at factor 2
(2 optimizer steps, the second window's gradient accumulated over 2 backwards), fp32. Every rank reports:

* ``params``: bytes of the storages its module's parameters live in: the local shard under FSDP2
  (``DTensor.to_local()``), the partition (``ds_tensor``) under ZeRO-3, the whole parameter otherwise;
* ``grads``: bytes of the gradients the optimizer steps on (FSDP2's sharded ``.grad``, DeepSpeed's fp32 partition
  gradient), read right after the optimizer's last step (before ``zero_grad``);
* ``optim``: the torch optimizer's state (AdamW's two moments and step) plus the tensors it steps that are not the
  module's parameters (DeepSpeed's fp32 master partitions), read at the same moment;
* ``peak live``: the most tensor bytes alive at once on the rank from building the task to the end of the run
  (model.pt included), tracked by a ``TorchDispatchMode`` that follows every storage an aten op returns and re-reads
  every tracked storage's size after each op (FSDP2 frees gathered parameters by resizing their storage to 0);
  ``transient`` is ``peak live`` minus the state above: gathered parameters, unsharded gradients, communication
  buffers, activations and the final gather, whichever peak together. Memory allocated outside aten ops (gloo's
  and DeepSpeed's own C++ buffers, Python objects) is not in it;
* ``peak RSS``: ``VmHWM`` of the rank's process (``/proc/self/status``), everything included.

Storages are counted once each (a flat buffer that several parameters view is counted whole, in the first column
that reaches it). The ratios are a row's per-rank figure over the same back end's figure on 1 rank.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.dirname(os.path.abspath(__file__))
BACKENDS = {  # row name -> the config's distributed section
    "ddp": {"backend": "ddp"},
    "fsdp": {"backend": "fsdp", "fsdp": {"wrap": ["Linear"]}},
    "zero2": {"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}},
    "zero3": {"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 3}}},
}
LABELS = {"ddp": "DDP", "fsdp": "FSDP2", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
MICRO, BATCHES, FACTOR = 8, 4, 2
MB = 2**20


# -- the task every run trains (``memory:task`` with bench/ on the path) ----------------------------------------
def task(samples: int, model: str = "20M"):
    """The benchmark's MLP (bench/workload.py) on ``samples`` random regression samples."""
    import torch
    from torch.utils.data import TensorDataset

    from workload import D_IN, D_OUT, build_model

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(samples, D_IN, generator=g), torch.randn(samples, D_OUT, generator=g)

    def loss_fn(model, batch):
        inputs, targets = batch
        return ((model(inputs) - targets) ** 2).sum(), targets.numel()

    return {"model": build_model(model), "dataset": TensorDataset(x, y), "loss_fn": loss_fn}


# -- measuring, inside a rank ------------------------------------------------------------------------------------
def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def local_tensor(t):
    """The tensor whose storage holds ``t`` on this rank: a DTensor's local shard, a ZeRO-3 partition, or ``t``."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local()
    partition = getattr(t, "ds_tensor", None)
    return t if partition is None else partition


class Storages:
    """Bytes of distinct storages, each counted once, in the first category that reaches it."""

    def __init__(self):
        self.seen: set[int] = set()

    def add(self, tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not hasattr(t, "untyped_storage"):
                continue
            t = local_tensor(t)
            storage = t.untyped_storage()
            if storage.data_ptr() == 0 or storage._cdata in self.seen:
                continue
            self.seen.add(storage._cdata)
            total += storage.nbytes()
        return total


def torch_optimizer(optimizer):
    """The torch optimizer under a wrapper (DeepSpeed's ZeRO optimizers keep theirs as ``.optimizer``)."""
    import torch

    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def state_bytes(module, optimizer) -> dict:
    """``params``, ``grads`` and ``optim`` of this rank (see the module docstring), in bytes."""
    inner = torch_optimizer(optimizer)
    stepped = [p for group in inner.param_groups for p in group["params"]]
    seen = Storages()
    params = seen.add(module.parameters())
    grads = seen.add(p.grad for p in stepped)
    optim = seen.add(v for state in inner.state.values() for v in state.values())
    optim += seen.add(stepped)  # DeepSpeed's fp32 master partitions (the module's own parameters are counted)
    return {"params": params, "grads": grads, "optim": optim}


def live_tracker():
    """A TorchDispatchMode tracking the bytes of every storage an aten op returns, and their peak at once."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages: dict[int, weakref.ref] = {}
            self.peak = 0

        def live(self) -> int:
            total, dead = 0, []
            for key, ref in self.storages.items():
                storage = ref()
                if storage is None:
                    dead.append(key)
                else:
                    total += storage.nbytes()
            for key in dead:
                del self.storages[key]
            return total

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    t = getattr(t, "_local_tensor", t)  # DTensor: its shard is the memory
                    try:
                        storage = t.untyped_storage()
                    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
                        continue
                    ref = self.storages.get(storage._cdata)
                    if ref is None or ref() is None:
                        self.storages[storage._cdata] = weakref.ref(storage)
            self.peak = max(self.peak, self.live())
            return out

    return LiveTensors()


def child(config: str, out: str, track: bool) -> None:
    """One rank: the worker's path (join, Trainer, fit), measured; writes ``out.rank<r>.json``."""
    import contextlib

    import torch

    torch.set_num_threads(1)
    from launcher.config import load_config
    from launcher.train.trainer import Trainer
    from launcher.worker import join, tear_down

    cfg = load_config(config)
    device = join(cfg)
    tracker = live_tracker() if track else None
    at_step: dict = {}
    with tracker or contextlib.nullcontext():
        trainer = Trainer(cfg, device)
        after_setup = tracker.live() if tracker else None

        def measure(*_, model=trainer.model, optimizer=trainer.optimizer):
            at_step.update(state_bytes(model, optimizer))
            if tracker:
                at_step["live"] = tracker.live()

        torch_optimizer(trainer.optimizer).register_step_post_hook(measure)
        began = time.perf_counter()
        trainer.fit()
        fit_s = time.perf_counter() - began
    rank = trainer.rank
    record = {"rank": rank, "world": trainer.world, **at_step, "peak_live": tracker.peak if tracker else None,
              "live_after_setup": after_setup, "peak_rss_mb": peak_rss_mb(), "fit_s": fit_s,
              "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in trainer.task.model.parameters())}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(record, f)
    del trainer
    tear_down()


# -- the table ---------------------------------------------------------------------------------------------------
def run_one(name: str, world: int, tmp: str, track: bool, batches: int = BATCHES,
            plain_malloc: bool = False) -> list[dict]:
    import yaml

    from launcher.launch import malloc

    out_dir = os.path.join(tmp, f"{name}-{world}")
    os.makedirs(out_dir)
    cfg = {
        "run": {"output_dir": os.path.join(out_dir, "run"), "seed": 0, "epochs": 1},
        "task": {"target": "memory:task", "args": {"samples": MICRO * batches * world}},
        "data": {"micro_batch_size": MICRO, "shuffle": False, "drop_last": False, "num_workers": 0},
        "accumulation": {"schedule": {0: FACTOR}, "normalize": "elements"},
        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        "lr_scheduler": None,
        "logging": {"progress": "none", "tensorboard": "off"},
        "distributed": {"nproc_per_node": world, **BACKENDS[name]},
    }
    path = os.path.join(out_dir, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    base = os.environ if plain_malloc else malloc.worker_env(os.environ)  # what `accum-sched run` starts with
    env = {**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([BENCH, ROOT]),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser(
               "~/.cache/accum-sched/torch_extensions"))}
    if BACKENDS[name]["backend"] == "deepspeed":
        env.setdefault("DS_ACCELERATOR", "cpu")
    prefix = os.path.join(out_dir, "record")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            os.path.abspath(__file__), "--child", path, prefix] + ([] if track else ["--no-track"])
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} on {world} ranks failed ({done.returncode}):\n{done.stderr[-6000:]}\n"
                         f"{done.stdout[-2000:]}")
    records = []
    for rank in range(world):
        with open(f"{prefix}.rank{rank}.json") as f:
            records.append(json.load(f))
    return records


def row(name: str, world: int, records: list[dict]) -> dict:
    """Per-rank MB: the largest rank's (rank 0 gathers model.pt), with every rank's peak RSS."""
    def top(key):
        values = [r[key] for r in records if r.get(key) is not None]
        return max(values) / MB if values else None

    state = max(r["params"] + r["grads"] + r["optim"] for r in records) / MB
    live = top("peak_live")
    return {"backend": name, "world": world, "params": top("params"), "grads": top("grads"), "optim": top("optim"),
            "state": state, "peak_live": live, "transient": None if live is None else live - state,
            "peak_live_per_rank": [None if r["peak_live"] is None else r["peak_live"] / MB for r in records],
            "rss": [r["peak_rss_mb"] for r in records], "fit_s": max(r["fit_s"] for r in records),
            "parameters": records[0]["parameters"]}


def print_table(rows: list[dict]) -> None:
    base = {r["backend"]: r for r in rows if r["world"] == 1}
    head = ["back end", "ranks", "params MB", "grads MB", "optim MB", "state MB", "x 1 rank", "peak live MB",
            "transient MB", "peak RSS MB (per rank)", "RSS x 1 rank"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = base.get(r["backend"])
        fmt = (lambda v: "-" if v is None else f"{v:.1f}")
        lines.append("| " + " | ".join([
            LABELS[r["backend"]], str(r["world"]), fmt(r["params"]), fmt(r["grads"]), fmt(r["optim"]),
            fmt(r["state"]), "-" if b is None else f"{r['state'] / b['state']:.3f}", fmt(r["peak_live"]),
            fmt(r["transient"]), "/".join(f"{v:.0f}" for v in r["rss"]),
            "-" if b is None else f"{max(r['rss']) / max(b['rss']):.3f}"]) + " |")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: " + ", ".join(BACKENDS))
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--no-track", action="store_true", help="no dispatch mode: peak RSS only, no 'peak live'")
    parser.add_argument("--batches", type=int, default=BATCHES, help="micro-batches per rank")
    parser.add_argument("--plain-malloc", action="store_true",
                        help="start the ranks without launcher/launch/malloc.py's settings (as before the fix)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, track=not args.no_track)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.backends.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                records = run_one(name, world, tmp, not args.no_track, args.batches, args.plain_malloc)
                rows.append(row(name, world, records))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{rows[0]['parameters'] / 1e6:.1f}M parameters, AdamW, fp32, {args.batches} micro-batches of {MICRO} per "
          f"rank at factor {FACTOR}; per-rank MB (the largest rank)")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
