"""The engine's own work per optimizer step, on a model too small to hide it: a one-layer DDP model, factor 1.

    torchrun --standalone --nproc_per_node 1 bench/step_overhead.py [--steps 200] [--rounds 12]
    torchrun --standalone --nproc_per_node 2 bench/step_overhead.py

Four loops over the same 200 micro-batches of 4 samples: ``hand`` (DDP's own C++ reduction, mean loss),
``sumhook`` (the same with the least Python comm hook: a SUM all-reduce and ``.then``; the loss carries
``1 / world``), ``engine`` (AccumulationEngine with ``micro_batch_size`` given: its comm hook, the window's
numbers riding in the bucket, one read per step) and ``carrier`` (the same engine on an ``accum_sched.wrap_ddp``
model: no comm hook, the numbers in DDP's own reduction). Each round runs every loop once, in an order shuffled per
round (the same on every rank); the first two rounds are dropped. Printed on rank 0: the median CPU (this process, all
threads) and wall microseconds per step.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from accum_sched import AccumulationEngine, wrap_ddp


def _reduced(fut):
    return fut.value()[0]


def sum_hook(process_group, bucket):
    return process_group.allreduce([bucket.buffer()]).get_future().then(_reduced)


def loops(batches: list, world: int) -> dict:
    def hand(hook: bool):
        model = DDP(torch.nn.Linear(8, 1))
        if hook:
            model.register_comm_hook(model.process_group, sum_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        divide = world if hook else 1

        def run(epoch):
            for x, y in batches:
                (((model(x) - y) ** 2).sum(-1).mean() / divide).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return run

    def engine(carrier: bool):
        layer = torch.nn.Linear(8, 1)
        model = wrap_ddp(layer) if carrier else DDP(layer)
        eng = AccumulationEngine(model, torch.optim.SGD(layer.parameters(), lr=0.01), 1, micro_batch_size=4)

        def run(epoch):
            for x, y in eng.micro_batches(batches, epoch):
                eng.backward(((model(x) - y) ** 2).sum(-1).sum(), x.shape[0])
        return run

    return {"hand": hand(False), "sumhook": hand(True), "engine": engine(False), "carrier": engine(True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(args.steps)]
    runs = loops(batches, dist.get_world_size())
    cpu, wall = {name: [] for name in runs}, {name: [] for name in runs}
    for r in range(args.rounds):
        for name in random.Random(r).sample(list(runs), len(runs)):
            dist.barrier()
            c, w = time.process_time(), time.perf_counter()
            runs[name](r)
            cpu[name].append((time.process_time() - c) / args.steps * 1e6)
            wall[name].append((time.perf_counter() - w) / args.steps * 1e6)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} rank(s), {args.steps} steps of Linear(8, 1) per round, {args.rounds - 2} "
              f"rounds after two dropped; torch {torch.__version__}")
        for name in runs:
            print(f"{name:8s} CPU {statistics.median(cpu[name][2:]):7.0f} us/step  wall "
                  f"{statistics.median(wall[name][2:]):7.0f} us/step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
