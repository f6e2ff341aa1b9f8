"""In-process A/B of the engine against the loop a user writes by hand, inside the same two processes.

    torchrun --standalone --nproc_per_node 2 bench/ab.py [--model 1M] [--factors 1,4,8] [--rounds 7]
    torchrun --standalone --nproc_per_node 2 bench/ab.py --deepspeed 2     # engine + DeepSpeed vs DeepSpeed alone

A finer instrument than bench/run.py for the engine's own overhead: every variant shares the processes, the data and
the machine's load; each round runs one epoch of every variant per factor, in a rotated order, and the ratio
(baseline time / variant time) is taken within the round, so load from other work on the machine cancels out. The
first round is a warm-up and is dropped. Printed: median [min-max] of the per-round ratios, wall clock and CPU time
(both ranks, all threads).

DDP variants: ``hand`` (baseline: plain DDP, no comm hook, no_sync off the boundary, mean loss / window size),
``engine`` (the defaults: no gradient norm, as in the hand-written loop), ``engine_norm`` (``norm_every=1``: the
norm and non-finite-gradient check at every step, taken in the comm hook), ``engine_nohook``
(``count_allreduce=False``: no comm hook; the window's numbers take one small all-reduce overlapping the last
backward), ``hand_hook`` (the baseline with a Python comm hook that only counts rounds: what any
Python hook costs). ``--deepspeed STAGE``: ``alone`` (baseline: DeepSpeed's own GAS, step() every micro-batch)
and ``engine`` (accum_sched driving the same DeepSpeed configuration).
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

from workload import Workload, build_model, make_optimizer, rank_data, sample_losses, windowed  # noqa: E402


def hand_written_epoch(ddp, optimizer, loader, factor):
    for (x, y), size, boundary in windowed(loader, factor):
        with contextlib.nullcontext() if boundary else ddp.no_sync():
            (sample_losses(ddp, x, y).mean() / size).backward()
        if boundary:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def ds_alone_epoch(ds_engine, loader, factor, world):
    ds_engine.set_train_batch_size(loader.batch_size * factor * world)
    for x, y in loader:
        ds_engine.backward(sample_losses(ds_engine, x, y).mean())
        ds_engine.step()


def engine_epoch(engine, loader, epoch):
    for x, y in engine.micro_batches(loader, epoch):
        engine.backward(sample_losses(engine.model, x, y).sum(), x.shape[0])


def _ds_engine(w: Workload, stage: int, factor: int):
    import deepspeed

    model = build_model(w.model)
    config = {"train_micro_batch_size_per_gpu": w.micro, "gradient_accumulation_steps": factor,
              "train_batch_size": w.micro * factor * w.world, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1,
              "timers": {"throughput": {"enabled": False}}}
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(w, model.parameters()), config=config)
    return ds_engine


def build_variants(args, w: Workload, schedule: dict) -> tuple[str, dict]:
    """(baseline name, {name: epoch function(loader, factor, epoch)})."""
    from accum_sched import AccumulationEngine

    if args.deepspeed is not None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from accum_sched.deepspeed_backend import ensure_torch_extensions_dir

        ensure_torch_extensions_dir()
        alone = _ds_engine(w, args.deepspeed, 1)
        ours = AccumulationEngine(_ds_engine(w, args.deepspeed, 1), None, schedule, micro_batch_size=w.micro)
        return "alone", {"alone": lambda loader, f, e: ds_alone_epoch(alone, loader, f, w.world),
                         "engine": lambda loader, f, e: engine_epoch(ours, loader, e)}
    hand_model = build_model(w.model)
    hand = DDP(hand_model, bucket_cap_mb=args.bucket_cap_mb)
    hand_opt = make_optimizer(w, hand_model.parameters())
    out = {"hand": lambda loader, f, e: hand_written_epoch(hand, hand_opt, loader, f)}
    if "hand_hook" in args.variants:  # the same loop with a Python comm hook that only counts: what a hook costs
        from accum_sched.backends import _counting_allreduce, _Counter

        hooked_model = build_model(w.model)
        hooked = DDP(hooked_model, bucket_cap_mb=args.bucket_cap_mb)
        hooked.register_comm_hook(_Counter(), _counting_allreduce)
        hooked_opt = make_optimizer(w, hooked_model.parameters())
        out["hand_hook"] = lambda loader, f, e: hand_written_epoch(hooked, hooked_opt, loader, f)
    for name, kwargs in (("engine", {}), ("engine_norm", {"norm_every": 1}),
                         ("engine_nohook", {"count_allreduce": False})):
        if name not in args.variants:
            continue
        model = build_model(w.model)
        engine = AccumulationEngine(DDP(model, bucket_cap_mb=args.bucket_cap_mb),
                                    make_optimizer(w, model.parameters()), schedule, micro_batch_size=w.micro,
                                    **kwargs)
        out[name] = lambda loader, f, e, engine=engine: engine_epoch(engine, loader, e)
    return "hand", out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1M")
    parser.add_argument("--batches", type=int, default=62)
    parser.add_argument("--factors", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--variants", default="engine,engine_norm")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--deepspeed", type=int, default=None, metavar="STAGE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    factors = [int(f) for f in args.factors.split(",")]
    w = Workload(model=args.model, batches=args.batches)
    loader = DataLoader(TensorDataset(*rank_data(w, rank)), batch_size=w.micro)
    # an engine runs one epoch per factor per round, so its schedule lists them in that order
    schedule = {i: factors[i % len(factors)] for i in range(len(factors) * args.rounds)}
    baseline, variants = build_variants(args, w, schedule)
    names = list(variants)
    wall = {f: {n: [] for n in names} for f in factors}
    cpu = {f: {n: [] for n in names} for f in factors}
    epoch = 0
    for r in range(args.rounds):
        for factor in factors:
            order = names[r % len(names):] + names[:r % len(names)]  # rotated: no variant always runs first
            for name in order:
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                variants[name](loader, factor, epoch)
                wall[factor][name].append(time.perf_counter() - t)
                cpu[factor][name].append(time.process_time() - c)
            epoch += 1
    for factor in factors:  # CPU seconds of both ranks: the work done, whatever the waiting for a busy machine
        for name in names:
            t = torch.tensor(cpu[factor][name], dtype=torch.float64)
            dist.all_reduce(t)
            cpu[factor][name] = t.tolist()
    if rank == 0:
        what = f"DeepSpeed ZeRO-{args.deepspeed}" if args.deepspeed is not None else "DDP"
        print(f"model {args.model}, {what}, {args.batches} micro-batches of {w.micro} per rank per epoch, "
              f"{args.rounds - 1} rounds after a warm-up; ratio = {baseline} time / variant time")
        for factor in factors:
            for name in names:
                if name == baseline:
                    continue
                base_w, base_c = wall[factor][baseline][1:], cpu[factor][baseline][1:]
                ratios = [b / v for b, v in zip(base_w, wall[factor][name][1:])]
                cpu_ratios = [b / v for b, v in zip(base_c, cpu[factor][name][1:])]
                print(f"factor {factor} {name:14s} wall {statistics.median(ratios):.3f} "
                      f"[{min(ratios):.3f}-{max(ratios):.3f}]  cpu {statistics.median(cpu_ratios):.3f} "
                      f"[{min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}]  {baseline} epoch "
                      f"{statistics.median(base_w):.3f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
