"""What a stream's end agreement costs: the engine over the same micro-batches handed in with a length and without.

    torchrun --standalone --nproc_per_node 2 bench/streams.py [--model 1M] [--factors 1,4] [--rounds 12]

``sized``: a list of micro-batches (``len()`` known: the epoch's length is agreed once, no per-micro-batch
collective); ``stream``: a generator over the same list (the engine's stream path at its default read-ahead R = 4:
one small asynchronous all-reduce per 4 micro-batches on the side gloo group, accum_sched/streams.py); ``stream1``:
the same at R = 1 (one all-reduce per micro-batch, two micro-batches held ahead); ``sized2``: the first again (an
A/A row: the instrument's own noise). Same processes, data, model and DDP set-up; each round trains one epoch of
every variant per factor in an order shuffled per round (the same on both ranks), every variant from the same
initial weights; the first round is a warm-up and is dropped. Printed: median [min-max] of the per-round ratio
sized epoch time / variant epoch time (1.0 = free; below 1 = slower), and the stream collectives the engine counted
per epoch. Rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from accum_sched import AccumulationEngine  # noqa: E402
from accum_sched.streams import READ_AHEAD  # noqa: E402
from workload import Workload, ab_inputs, build_model, make_optimizer, sample_losses  # noqa: E402

VARIANTS = ("sized", "stream", "stream1", "sized2")


def as_given(name: str, batches: list):
    return (b for b in batches) if name.startswith("stream") else batches


def epoch(name: str, initial: dict, w: Workload, batches: list, factor: int) -> tuple[float, int]:
    """One epoch of variant ``name`` from ``initial`` weights: (wall seconds, stream collectives)."""
    model = build_model(w.model)
    model.load_state_dict(initial)
    ddp = DDP(model)
    engine = AccumulationEngine(ddp, make_optimizer(w, ddp.parameters()), schedule=factor,
                                read_ahead=1 if name == "stream1" else READ_AHEAD)
    dist.barrier()
    began = time.perf_counter()
    for x, y in engine.micro_batches(as_given(name, batches), 0):
        engine.backward(sample_losses(ddp, x, y).sum(), x.shape[0])
    seconds = time.perf_counter() - began
    return seconds, engine.stream_collectives


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1M")
    parser.add_argument("--batches", type=int, default=62)
    parser.add_argument("--factors", default="1,4")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, w, batches, initial, factors, order = ab_inputs(args.model, args.batches, args.factors)
    times = {f: {n: [] for n in VARIANTS} for f in factors}
    collectives = {f: {} for f in factors}
    for _ in range(args.rounds):
        for factor in factors:
            names = list(VARIANTS)
            order.shuffle(names)
            for name in names:
                seconds, count = epoch(name, initial, w, batches, factor)
                times[factor][name].append(seconds)
                collectives[factor][name] = count
    if rank == 0:
        print(f"model {args.model}, DDP over gloo, {len(batches)} micro-batches of {w.micro} per rank per epoch, "
              f"{args.rounds - 1} rounds after a warm-up; ratio = sized time / variant time; torch "
              f"{torch.__version__}, {os.cpu_count()} CPUs")
        for factor in factors:
            base = times[factor]["sized"][1:]
            for name in VARIANTS[1:]:
                ratios = [b / v for b, v in zip(base, times[factor][name][1:])]
                print(f"factor {factor} {name:7s} {statistics.median(ratios):.3f} [{min(ratios):.3f}-"
                      f"{max(ratios):.3f}]  sized epoch {statistics.median(base):.3f} s  stream collectives per "
                      f"epoch: {collectives[factor][name]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
