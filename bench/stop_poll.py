"""What stop polling costs under FSDP2 and DeepSpeed: the engine with ``stop_at="micro_batch"`` (as `accum-sched run`
builds it: one small asynchronous all-reduce of the stop flag per micro-batch on the side gloo group,
accum_sched/stop_poll.py) next to the same back end with it off (``stop_at="boundary"``).

    torchrun --standalone --nproc_per_node 2 bench/stop_poll.py --backend fsdp [--model 1M] [--factors 1,4]
    torchrun --standalone --nproc_per_node 2 bench/stop_poll.py --backend ds2  [--rounds 12] [--poll-every 1]

``off``: stop polling off; ``on``: on; ``off2``: off again (an A/A row: the instrument's own noise). Same processes,
data, model and back-end set-up; each round trains one epoch of every variant per factor in an order shuffled per
round (the same on both ranks), every variant from the same initial weights, the back end built before the clock
starts; the first round is a warm-up and is dropped. Printed: median [min-max] of the per-round ratio off epoch time /
variant epoch time (1.0 = free; below 1 = slower), in wall time and in CPU time (both ranks' process CPU seconds,
gloo's threads included: what the poll costs in work, less disturbed by other load on the machine than the wall
clock), and the polls (stop-flag all-reduces) per epoch. Rank 0 prints.
``--poll-alone N``: the poll by itself, N calls with no training between them (its cost per micro-batch, wall and
CPU, an upper bound). ``--backend``: ``fsdp`` (FSDP2, every Linear then the root sharded), ``ds0`` / ``ds2``
(DeepSpeed ZeRO 0 / 2). ``--poll-every K``: the ``on`` variant polls every K micro-batches (``stop_poll_every``).
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

from accum_sched import AccumulationEngine  # noqa: E402
from workload import Workload, ab_inputs, build_model, make_optimizer, sample_losses  # noqa: E402

VARIANTS = ("off", "on", "off2")


def _fsdp(initial: dict, w: Workload):
    from variants_fsdp import shard

    model = build_model(w.model)
    model.load_state_dict(initial)
    model = shard(model)
    return model, make_optimizer(w, model.parameters())


def _deepspeed(initial: dict, w: Workload, stage: int, factor: int):
    import deepspeed  # heavy and optional: only the DeepSpeed rows need it

    model = build_model(w.model)
    model.load_state_dict(initial)
    config = {"train_micro_batch_size_per_gpu": w.micro, "gradient_accumulation_steps": factor,
              "train_batch_size": w.micro * factor * w.world, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1}
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(w, model.parameters()), config=config)
    return ds_engine, None


def epoch(name: str, backend: str, initial: dict, w: Workload, batches: list, factor: int,
          poll_every: int) -> tuple[float, float, int, str]:
    """One epoch of variant ``name``: (wall seconds, CPU seconds of both ranks, stop-flag all-reduces, the engine's
    stop_at)."""
    if backend == "fsdp":
        model, optimizer = _fsdp(initial, w)
    else:
        model, optimizer = _deepspeed(initial, w, int(backend[2:]), factor)
    extra = {"stop_poll_every": poll_every} if poll_every != 1 else {}
    engine = AccumulationEngine(model, optimizer, schedule=factor, micro_batch_size=w.micro,
                                stop_at="micro_batch" if name == "on" else "boundary", **extra)
    poll = engine._stop_poll
    polls = [0]
    if poll is not None:  # count the stop flag's all-reduces (the poll's own attribute, set only when one starts)
        start = poll.poll

        def counted(requested):
            before = poll._work
            agreed = start(requested)
            polls[0] += poll._work is not None and poll._work is not before
            return agreed
        poll.poll = counted
    dist.barrier()
    began, cpu_began = time.perf_counter(), time.process_time()
    for x, y in engine.micro_batches(batches, 0):
        engine.backward(sample_losses(model, x, y).sum(), x.shape[0])
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    total_cpu = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(total_cpu)  # both ranks' CPU seconds (gloo's threads included), after the clock stopped
    return seconds, float(total_cpu), polls[0], engine.stop_at


def poll_alone(calls: int, every: int) -> tuple[float, float]:
    """The poll by itself, no training between calls: (wall, CPU) microseconds per call on this rank, CPU with
    gloo's threads. An upper bound of its cost per micro-batch (in training each all-reduce has a whole micro-batch
    to finish in, here it has a few microseconds)."""
    from accum_sched.stop_poll import StopPoll

    poll = StopPoll(dist.get_world_size(), every)
    for _ in range(50):  # warm-up
        poll.poll(False)
    poll.drain()
    dist.barrier()
    began, cpu_began = time.perf_counter(), time.process_time()
    for _ in range(calls):
        poll.poll(False)
    poll.drain()
    return (time.perf_counter() - began) / calls * 1e6, (time.process_time() - cpu_began) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="fsdp", choices=("fsdp", "ds0", "ds2"))
    parser.add_argument("--model", default="1M")
    parser.add_argument("--batches", type=int, default=62)
    parser.add_argument("--factors", default="1,4")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--poll-every", type=int, default=1, help="the engine's stop_poll_every (micro-batches)")
    parser.add_argument("--poll-alone", type=int, default=0, metavar="CALLS",
                        help="time CALLS polls with no training between them (every 1 and --poll-every), then exit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.poll_alone:
        dist.init_process_group("gloo")
        for every in sorted({1, args.poll_every}):
            wall, cpu = poll_alone(args.poll_alone, every)
            if dist.get_rank() == 0:
                print(f"poll alone, every {every}: {wall:.1f} us wall, {cpu:.1f} us CPU per call (rank 0, "
                      f"{args.poll_alone} calls)", flush=True)
        dist.destroy_process_group()
        return
    if args.backend.startswith("ds"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

        ensure_torch_extensions_dir()
    rank, w, batches, initial, factors, order = ab_inputs(args.model, args.batches, args.factors)
    times = {f: {n: [] for n in VARIANTS} for f in factors}
    cpu_times = {f: {n: [] for n in VARIANTS} for f in factors}
    polls, stop_at = {f: {} for f in factors}, {}
    for _ in range(args.rounds):
        for factor in factors:
            names = list(VARIANTS)
            order.shuffle(names)
            for name in names:
                seconds, cpu, count, stop_at[name] = epoch(name, args.backend, initial, w, batches, factor,
                                                           args.poll_every)
                times[factor][name].append(seconds)
                cpu_times[factor][name].append(cpu)
                polls[factor][name] = count
    if rank == 0:
        print(f"{args.backend}, model {args.model}, gloo, 2 processes, {len(batches)} micro-batches of {w.micro} per "
              f"rank per epoch, {args.rounds - 1} rounds after a warm-up, stop_poll_every {args.poll_every}; ratio = "
              f"off time / variant time; stop_at {stop_at}; torch {torch.__version__}, {os.cpu_count()} CPUs")
        for factor in factors:
            base, cpu_base = times[factor]["off"][1:], cpu_times[factor]["off"][1:]
            for name in VARIANTS[1:]:
                ratios = [b / v for b, v in zip(base, times[factor][name][1:])]
                cpu = [b / v for b, v in zip(cpu_base, cpu_times[factor][name][1:])]
                print(f"factor {factor} {name:4s} wall {statistics.median(ratios):.3f} [{min(ratios):.3f}-"
                      f"{max(ratios):.3f}]  CPU {statistics.median(cpu):.3f} [{min(cpu):.3f}-{max(cpu):.3f}]  "
                      f"off epoch {statistics.median(base):.3f} s wall, {statistics.median(cpu_base):.3f} s CPU  "
                      f"polls per epoch: {polls[factor][name]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
