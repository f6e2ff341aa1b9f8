"""A/B of the engine against the hand-written no_sync loop inside the same two processes, alternating epochs.

    torchrun --standalone --nproc_per_node 2 bench/ab.py [--model 1M] [--factors 1,8] [--rounds 5] [--profile]

A finer instrument than bench/run.py for the engine's own overhead: both loops share processes, data and
machine load, epoch after epoch, so load from other work on the machine cancels out of the ratio. --profile runs
the engine's epochs under pyinstrument on rank 0 (pip install pyinstrument) and prints where its time goes.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from workload import Workload, build_model, make_optimizer, rank_data, sample_losses  # noqa: E402


def hand_written_epoch(ddp, optimizer, loader, factor):
    n = len(loader)
    for i, (x, y) in enumerate(loader):
        start = i - i % factor
        size = min(factor, n - start)
        boundary = i == start + size - 1
        with contextlib.nullcontext() if boundary else ddp.no_sync():
            (sample_losses(ddp, x, y).mean() / size).backward()
        if boundary:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1M")
    parser.add_argument("--batches", type=int, default=94)
    parser.add_argument("--factors", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from accum_sched import AccumulationEngine
    from accum_sched.backends import _counting_allreduce, _Counter

    factors = [int(f) for f in args.factors.split(",")]
    w = Workload(model=args.model, batches=args.batches)
    loader = DataLoader(TensorDataset(*rank_data(w, rank)), batch_size=w.micro)
    # the engine runs one epoch per factor per round, so its schedule lists them in that order
    schedule = {i: factors[i % len(factors)] for i in range(len(factors) * args.rounds)}
    model = build_model(w.model)
    engine = AccumulationEngine(DDP(model), make_optimizer(w, model.parameters()), schedule, micro_batch_size=w.micro)
    hand_model = build_model(w.model)
    hand = DDP(hand_model)
    hand.register_comm_hook(_Counter(), _counting_allreduce)  # the engine counts rounds too: same hook cost
    hand_opt = make_optimizer(w, hand_model.parameters())
    profiler = None
    if args.profile and rank == 0:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
    times = {f: {"engine": [], "hand": []} for f in factors}
    cpu = {f: {"engine": [], "hand": []} for f in factors}
    epoch = 0
    for r in range(args.rounds):
        for factor in factors:
            for kind in (("engine", "hand") if r % 2 == 0 else ("hand", "engine")):
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                if kind == "engine":
                    if profiler is not None and r > 0:
                        profiler.start()
                    for x, y in engine.micro_batches(loader, epoch):
                        engine.backward(sample_losses(engine.model, x, y).sum(), x.shape[0])
                    if profiler is not None and r > 0:
                        profiler.stop()
                else:
                    hand_written_epoch(hand, hand_opt, loader, factor)
                times[factor][kind].append(time.perf_counter() - t)
                cpu[factor][kind].append(time.process_time() - c)
            epoch += 1
    # CPU seconds of both ranks (all threads): the work done, insensitive to waiting for a busy machine's cores
    for factor in factors:
        for kind in ("engine", "hand"):
            t = torch.tensor(cpu[factor][kind], dtype=torch.float64)
            dist.all_reduce(t)
            cpu[factor][kind] = t.tolist()
    if rank == 0:
        for factor in factors:
            cpu_ratios = [h / e for e, h in zip(cpu[factor]["engine"][1:], cpu[factor]["hand"][1:])]
            print(f"factor {factor}: engine/hand-written CPU-time efficiency {statistics.median(cpu_ratios):.3f} "
                  f"[{min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}]")
            ratios = [h / e for e, h in zip(times[factor]["engine"][1:], times[factor]["hand"][1:])]
            print(f"factor {factor}: engine/hand-written throughput {statistics.median(ratios):.3f} "
                  f"[{min(ratios):.3f}-{max(ratios):.3f}] over {len(ratios)} rounds (first round = warm-up); "
                  f"hand-written epoch {statistics.median(times[factor]['hand']):.3f} s")
        if profiler is not None:
            print(profiler.output_text(unicode=False, color=False, show_all=False))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
