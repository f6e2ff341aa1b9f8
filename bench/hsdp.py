"""FSDP2 on a 2 x 2 mesh (HSDP, 4 gloo ranks): collectives and memory per optimizer step in each gradient-sync
mode, with and without ``keep_gathered``.

    PYTHONPATH=. python bench/hsdp.py [--model 1M|20M] [--json out.json]

One ``torchrun --standalone --nproc_per_node 4`` runs every row in turn on the same rank processes: the benchmark's
MLP (bench/workload.py) with every Linear, then the root, sharded by ``fully_shard`` on
``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))``, trained by the engine on epoch 0 at factor 1 and epoch
1 at factor 4 (4 full windows); the counts and memory are of epoch 1, per optimizer step, from rank 0.

* Collectives are counted here, not by the engine: ``torch.distributed.all_gather_single`` /
  ``reduce_scatter_single`` / ``all_reduce`` are wrapped (FSDP2 and the engine look them up there at call time),
  each call filed under the process group it ran on: the mesh's ``shard`` or ``replicate`` group, or ``other``
  (the engine's few-number all-reduce of the window's counts).
* ``held``: tensor bytes alive after a non-boundary micro-batch's backward above those alive right after the
  previous optimizer step (a ``TorchDispatchMode`` that follows every storage, bench/memory.py): what the mode
  keeps from one micro-batch to the next. ``grads`` / ``gathered`` split it by where FSDP2 keeps it: the window's
  gradient (unsharded accumulation, sharded ``.grad``, HSDP partial shard) and the gathered parameters.
  ``peak``: the most tensor bytes alive at once during the epoch, above the same base.
* ``max abs diff``: the largest parameter difference from the plain-torch large-batch reference.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
MESH = (2, 2)
ROWS = [(mode, keep) for mode in ("boundary", "every_micro_batch", "reduce_scatter") for keep in (False, True)]
MB = 2**20


def workload(model: str):
    from workload import Workload

    return Workload(model=model, micro=32, batches=16, factors=(4,), world=MESH[0] * MESH[1])


# -- inside a rank -----------------------------------------------------------------------------------------------
def count_collectives(counts: dict, names: dict) -> None:
    """Wrap the torch.distributed functions FSDP2 and the engine call; ``counts[(name, group)] += 1``."""
    import torch.distributed as dist

    def counting(fn, name):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            group = names.get(getattr(kwargs.get("group"), "group_name", None), "other")
            counts[(name, group)] = counts.get((name, group), 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    dist.all_gather_single = counting(dist.all_gather_single, "all_gather")
    dist.reduce_scatter_single = counting(dist.reduce_scatter_single, "reduce_scatter")
    dist.all_reduce = counting(dist.all_reduce, "all_reduce")


def fsdp_held(model) -> tuple[int, int]:
    """(gradient bytes, gathered-parameter bytes) where FSDP2 keeps them now, each storage once."""
    from accum_sched.backends.fsdp import _param_groups, fsdp_modules

    seen, grads, gathered = set(), 0, 0

    def size(t) -> int:
        if t is None:
            return 0
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        if storage._cdata in seen:
            return 0
        seen.add(storage._cdata)
        return storage.nbytes()

    for module in fsdp_modules(model):
        for group in _param_groups(module):
            grads += size(getattr(group, "_partial_reduce_output", None))
            for p in group.fsdp_params:
                unsharded = getattr(p, "_unsharded_param", None)
                grads += size(p.sharded_param.grad) + size(p.unsharded_accumulated_grad)
                grads += size(None if unsharded is None else unsharded.grad)
                gathered += size(unsharded) + sum(size(t) for t in p.all_gather_outputs)
    return grads, gathered


def train(w, mode: str, keep: bool, mesh, counts: dict, tracker) -> dict:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from accum_sched import AccumulationEngine
    from workload import build_model, make_optimizer, rank_data, sample_losses

    gc.collect()  # the previous row's model (FSDP2 holds reference cycles) goes now, not mid-epoch
    model = build_model(w.model)
    for module in model:
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = AccumulationEngine(model, make_optimizer(w, model.parameters()), w.schedule(), micro_batch_size=w.micro,
                                gradient_sync=mode, keep_gathered=keep)
    base = {"live": 0}
    engine.on_step(lambda info: base.update(live=tracker.live()))
    x, y = rank_data(w, torch.distributed.get_rank())
    loader = DataLoader(TensorDataset(x, y), batch_size=w.micro, shuffle=False)
    out = {"held": 0, "grads": 0, "gathered": 0}
    for epoch in range(w.epochs):
        if epoch == 1:
            counts.clear()
            tracker.peak = tracker.live()
            steps = engine.optimizer_steps
        for i, (xb, yb) in enumerate(engine.micro_batches(loader, epoch)):
            engine.backward(sample_losses(model, xb, yb).sum(), xb.shape[0])
            if epoch == 1 and (i + 1) % w.factor_of_epoch(epoch):  # inside a window: what it holds
                held = tracker.live() - base["live"]
                if held > out["held"]:
                    grads, gathered = fsdp_held(model)
                    out.update(held=held, grads=grads, gathered=gathered)
    steps = engine.optimizer_steps - steps
    out["peak"] = tracker.peak - base["live"]
    out["per_step"] = {f"{name}/{group}": n / steps for (name, group), n in sorted(counts.items())}
    out["params"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return out


def child(model_name: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memory import live_tracker

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    names = {mesh.get_group(d).group_name: d for d in ("replicate", "shard")}
    counts: dict = {}
    count_collectives(counts, names)
    w = workload(model_name)
    rows = []
    with live_tracker() as tracker:
        for mode, keep in ROWS:
            rows.append({"mode": mode, "keep_gathered": keep, **train(w, mode, keep, mesh, counts, tracker)})
    if dist.get_rank() == 0:
        from workload import reference

        want = reference(w)
        for r in rows:
            r["max_diff"] = max((g - p).abs().max().item() for g, p in zip(r.pop("params"), want))
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


# -- the table ---------------------------------------------------------------------------------------------------
COLUMNS = [("all_gather/shard", "all-gathers"), ("reduce_scatter/shard", "reduce-scatters"),
           ("all_reduce/replicate", "all-reduces across replicas"), ("all_reduce/other", "engine all-reduces")]


def print_table(rows: list[dict], model: str) -> None:
    print(f"{model} MLP, 2 x 2 mesh (4 gloo ranks), factor 4; per optimizer step, rank 0; MB per rank")
    head = ["gradient_sync", "keep_gathered"] + [c for _, c in COLUMNS] + ["held MB", "of it gradient",
                                                                         "of it gathered params", "peak MB",
                                                                         "max abs diff"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        counts = [f"{r['per_step'].get(k, 0):g}" for k, _ in COLUMNS]
        mem = [f"{r[k] / MB:.2f}" for k in ("held", "grads", "gathered", "peak")]
        print("| " + " | ".join([f"`{r['mode']}`", str(r["keep_gathered"]).lower(), *counts, *mem,
                                 f"{r['max_diff']:.1e}"]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1M", choices=("1M", "20M"))
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, BENCH)
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([BENCH, ROOT])}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={MESH[0] * MESH[1]}",
                os.path.abspath(__file__), "--child", args.model, out]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"failed ({done.returncode}):\n{done.stderr[-6000:]}\n{done.stdout[-2000:]}")
        with open(out) as f:
            rows = json.load(f)
    print_table(rows, args.model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
