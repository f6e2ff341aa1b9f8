"""In-process A/B of the engine against the loop a user writes by hand, inside the same two processes.

    torchrun --standalone --nproc_per_node 2 bench/ab.py [--model 1M] [--factors 1,4,8] [--rounds 16]
    torchrun --standalone --nproc_per_node 2 bench/ab.py --deepspeed 2     # engine + DeepSpeed vs DeepSpeed alone
    torchrun --standalone --nproc_per_node 2 bench/ab.py --factors 1,4 --baseline engine --variants compiled,engine2
    torchrun --standalone --nproc_per_node 2 bench/ab.py --factors 1,4 --baseline engine --variants stream,engine2

A finer instrument than bench/run.py for the engine's own overhead. Every variant shares the processes, the data
and the machine's load. Each round trains one epoch of every variant per factor, interleaved **window by window**:
window 1 of every variant, then window 2 of every variant, ..., in an order shuffled at every window (the same on
both ranks; a fixed rotation would make each variant always follow the same one and inherit its leftovers, such as
a garbage collection its allocations triggered), each window started on both ranks together (a barrier, not timed).
A variant's epoch time is the sum of its windows' times, so a burst of load from elsewhere hits every variant
within a few tens of milliseconds of each other and cancels in the ratio (baseline epoch time / variant epoch
time), taken per round. The engine steps lazily (when the next micro-batch is asked for, or at the end of the
epoch), so its step lands in its next window's time; the sum over the epoch counts everything once. The first round
is a warm-up and is dropped. Printed: median [min-max] of the per-round ratios, wall clock and CPU time (both ranks,
all threads).

``hand2`` is a second, identical hand-written loop: its row is the instrument's own noise (an A/A test), to read
the other rows against.

DDP variants: ``hand`` (baseline: plain DDP, no comm hook, no_sync off the boundary, mean loss / window size),
``hand2`` (the same again), ``engine`` (the defaults: no gradient norm, as in the hand-written loop),
``engine_norm`` (``norm_every=1``: the norm and non-finite-gradient check at every step, taken in the comm hook),
``engine_nohook`` (``count_allreduce=False``: no comm hook; the window's numbers take one small all-reduce
overlapping the last backward), ``hand_hook`` (the baseline with the library's counting comm hook, which wraps
torch's Python allreduce hook: that one divides every bucket by the world size, one more pass), ``hand_sumhook``
(the baseline with the least Python comm hook there is, a SUM all-reduce of the bucket and ``.then`` handing it
back, the loss divided by the world size instead: what a Python hook costs by itself), ``hand_enghook`` (the
baseline on the engine's own comm hook, carrying a window's numbers in a bucket of each boundary backward and read
back after it: what the engine's hook costs, apart from the rest of the engine's work), ``engine_carrier`` (the
engine on a model built with ``accum_sched.wrap_ddp``: no comm hook, the window's numbers in a parameter of their
own that DDP's C++ reducer sums with the gradients), ``hand_carrier`` (the baseline on a ``wrap_ddp`` model,
carrying a window's numbers as the engine does there and reading them back: what carrying costs without a hook),
``stream`` / ``stream1`` / ``stream8`` (``engine`` handed the same micro-batches as a generator without
``len()``: the stream path at read_ahead 4 / 1 / 8;
with ``--baseline engine`` the ratios read the stream's end agreement against the sized loader). ``--deepspeed
STAGE``: ``alone`` (baseline: DeepSpeed's own GAS, step() every micro-batch), ``alone2`` (the same again) and
``engine`` (accum_sched driving the same DeepSpeed configuration). ``--fsdp``: the engine on FSDP2 (every Linear,
then the root sharded), variant ``engine``.

Stop polling (``stop_at="micro_batch"``, as `accum-sched run` builds the engine): with ``--fsdp`` or ``--deepspeed
STAGE`` and ``--baseline engine``, ``poll`` is the engine with the poll on as `accum-sched run` runs it (the config's
defaults: ``stop_poll_min_ms`` 100), ``poll1`` on at every micro-batch with no time floor, ``poll4`` with
``stop_poll_every=4`` (no floor), and ``engine2`` the engine again (the A/A row)::

    torchrun --standalone --nproc_per_node 2 bench/ab.py --fsdp --factors 1,4 --baseline engine \
        --variants poll,engine2,poll1
    torchrun --standalone --nproc_per_node 2 bench/ab.py --deepspeed 2 --factors 1,4 --baseline engine \
        --variants poll,engine2,poll1

torch.compile (``run.compile``): ``compiled`` is ``engine`` with the model's forward compiled in place, as
`accum-sched run` does it (launcher/backends/compile.py), before the DDP wrap; ``engine2`` is ``engine`` again. With
``--baseline engine`` the ratios read compiled against eager. Each round compiles the fresh model again; that lands
in the untimed warm-up epoch (every micro-batch of the workload is full, so nothing recompiles later).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from accum_sched import wrap_ddp  # noqa: E402
from workload import Workload, build_model, make_optimizer, rank_data, sample_losses, windowed  # noqa: E402


class HandWritten:
    """The loop a user writes: no_sync off the boundary, mean loss divided by the window's size."""

    def __init__(self, ddp, optimizer, divide: int = 1):
        self.ddp, self.optimizer, self.divide = ddp, optimizer, divide  # divide: what the reduction does not

    def start(self, loader, factor, epoch):
        self.batches = windowed(loader, factor)

    def window(self, size):
        for _ in range(size):
            (x, y), micro_batches, boundary = next(self.batches)
            if boundary:
                self.before_boundary()
            with contextlib.nullcontext() if boundary else self.ddp.no_sync():
                loss = sample_losses(self.ddp, x, y).mean() / (micro_batches * self.divide)
                (self.boundary_loss(loss) if boundary else loss).backward()
            if boundary:
                self.after_boundary()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)

    def before_boundary(self):
        pass

    def boundary_loss(self, loss):
        return loss

    def after_boundary(self):
        pass

    def finish(self):
        pass


class HandEngineHook(HandWritten):
    """The hand-written loop with the engine's own comm hook (accum_sched.backends.ddp_hook) driving DDP's reduction:
    it sums (the loss carries 1 / world) and carries a window's numbers (a vector of window_stats.SIZE) in a bucket
    of every boundary backward, read back after it, as the engine does; none of the engine's other work."""

    def __init__(self, ddp, optimizer, world: int):
        from accum_sched import window_stats
        from accum_sched.backends import ddp_hook

        super().__init__(ddp, optimizer, divide=world)
        self.hook = ddp_hook.install(ddp, self)
        self.stats = torch.zeros(window_stats.SIZE)

    def before_boundary(self):
        self.hook.pending_stats = self.stats

    def after_boundary(self):
        if self.hook.reduced_stats is None:
            raise RuntimeError("the window's numbers did not ride in a bucket")
        self.hook.reduced_stats = None


class HandCarrier(HandWritten):
    """The hand-written loop on a model built with ``accum_sched.wrap_ddp``: DDP's own reduction (no comm hook)
    carries a window's numbers in the carrier parameter, added to the boundary loss as the engine adds them, and
    read back to the host after the backward (the engine's one read per step); none of the engine's other work."""

    def __init__(self, ddp, optimizer, world: int):
        from accum_sched import window_stats

        super().__init__(ddp, optimizer)
        self.world, self.carrier = world, ddp.module.window
        self.stats = torch.ones(window_stats.SIZE)

    def boundary_loss(self, loss):
        return loss + (self.carrier * self.stats).sum()

    def after_boundary(self):
        reduced, self.carrier.grad = self.carrier.grad, None
        if (reduced * self.world).tolist()[0] != self.world:
            raise RuntimeError("the window's numbers did not ride in DDP's reduction")


class DeepSpeedAlone:
    """DeepSpeed's own accumulation: GAS set for the epoch, backward and step() on every micro-batch."""

    def __init__(self, ds_engine, world):
        self.ds, self.world = ds_engine, world

    def start(self, loader, factor, epoch):
        self.ds.set_train_batch_size(loader.batch_size * factor * self.world)
        self.batches = iter(loader)

    def window(self, size):
        for _ in range(size):
            x, y = next(self.batches)
            self.ds.backward(sample_losses(self.ds, x, y).mean())
            self.ds.step()

    def finish(self):
        pass


class Engine:
    """accum_sched: the engine's micro-batch iterator, summed losses and element counts."""

    def __init__(self, engine):
        self.engine = engine

    def start(self, loader, factor, epoch):
        self.batches = self.engine.micro_batches(loader, epoch)
        self.ahead = None  # the next micro-batch, taken already (None before the epoch's first, timed with it)

    def window(self, size):
        if self.ahead is None:
            self.ahead = next(self.batches)  # the epoch's agreement runs here, in the first window's slot
        for _ in range(size):
            x, y = self.ahead
            self.engine.backward(sample_losses(self.engine.model, x, y).sum(), x.shape[0])
            # The window's step runs when the iterator is asked for the next micro-batch, as in a user's loop:
            # ask inside this window's slot. Asked in the next slot (as before), the step ran after the other
            # variants' windows had pushed this model's gradients and weights out of the cache, a cost no loop pays.
            self.ahead = next(self.batches, None)

    def finish(self):
        if self.ahead is not None:
            raise RuntimeError("the engine yielded more micro-batches than the epoch has")


class StreamEngine(Engine):
    """The engine handed the same micro-batches as a generator (no ``len()``): its stream path, whose end the ranks
    agree on as it comes (accum_sched/streams.py)."""

    def start(self, loader, factor, epoch):
        self.batches = self.engine.micro_batches((batch for batch in loader), epoch)
        self.ahead = None


def _reduced(fut):
    return fut.value()[0]


def sum_hook(process_group, bucket):
    """The least a Python comm hook does: launch the bucket's SUM all-reduce, hand its one tensor back."""
    return process_group.allreduce([bucket.buffer()]).get_future().then(_reduced)


def _ds_engine(w: Workload, stage: int, factor: int):
    import deepspeed

    model = build_model(w.model)
    config = {"train_micro_batch_size_per_gpu": w.micro, "gradient_accumulation_steps": factor,
              "train_batch_size": w.micro * factor * w.world, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1,
              "timers": {"throughput": {"enabled": False}}}
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(w, model.parameters()), config=config)
    return ds_engine


def build_variants(args, w: Workload, schedule: dict, order: random.Random) -> tuple[str, dict]:
    """(baseline name, {name: variant}) in the order given; built in an order shuffled by ``order`` (seeded the same
    on every rank)."""
    wanted = args.variants.split(",")
    baseline = args.baseline or ("alone" if args.deepspeed is not None else "engine" if args.fsdp else "hand")
    names = [baseline] + [n for n in wanted if n != baseline]
    built = {name: None for name in names}
    for name in order.sample(names, len(names)):
        built[name] = build_variant(name, args, w, schedule)
    return baseline, built


def build_variant(name: str, args, w: Workload, schedule: dict):
    from accum_sched import AccumulationEngine

    if args.deepspeed is not None or args.fsdp:
        if args.deepspeed is not None and name in ("alone", "alone2"):
            return DeepSpeedAlone(_ds_engine(w, args.deepspeed, 1), w.world)
        if name not in POLL_KWARGS:
            known = ("alone2, " if args.deepspeed is not None else "") + ", ".join(POLL_KWARGS)
            raise SystemExit(f"--variants: unknown variant {name!r} with {'--fsdp' if args.fsdp else '--deepspeed'} "
                             f"({known})")
        if args.fsdp:
            from variants_fsdp import shard

            model = shard(build_model(w.model))
            optimizer = make_optimizer(w, model.parameters())
        else:  # a DeepSpeed engine owns its optimizer
            model, optimizer = _ds_engine(w, args.deepspeed, 1), None
        return Engine(AccumulationEngine(model, optimizer, schedule, micro_batch_size=w.micro, **POLL_KWARGS[name]))
    if name in ("hand", "hand2", "hand_hook", "hand_sumhook", "hand_enghook", "hand_carrier"):
        model = build_model(w.model)
        if name == "hand_carrier":
            return HandCarrier(wrap_ddp(model, bucket_cap_mb=args.bucket_cap_mb), make_optimizer(w, model.parameters()),
                               w.world)
        ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
        if name == "hand_enghook":
            return HandEngineHook(ddp, make_optimizer(w, model.parameters()), w.world)
        if name == "hand_hook":  # the same loop with the counting hook (torch's dividing Python hook inside)
            from accum_sched.backends.counting import CountingState, counting_allreduce

            ddp.register_comm_hook(CountingState(), counting_allreduce)
        if name == "hand_sumhook":  # the bare cost of a Python comm hook: it sums, the loss carries 1 / world
            ddp.register_comm_hook(ddp.process_group, sum_hook)
            return HandWritten(ddp, make_optimizer(w, model.parameters()), divide=w.world)
        return HandWritten(ddp, make_optimizer(w, model.parameters()))
    if name in ENGINE_KWARGS or name == "compiled":
        model = build_model(w.model)
        if name == "compiled":
            from launcher.backends.compile import compile_module

            compile_module(model, {})
        wrap = StreamEngine if name.startswith("stream") else Engine
        ddp = (wrap_ddp if name == "engine_carrier" else DDP)(model, bucket_cap_mb=args.bucket_cap_mb)
        return wrap(AccumulationEngine(ddp,
                                       make_optimizer(w, model.parameters()), schedule, micro_batch_size=w.micro,
                                       **ENGINE_KWARGS.get(name, {})))
    raise SystemExit(f"--variants: unknown variant {name!r} (hand2, hand_hook, hand_sumhook, hand_enghook, "
                     f"hand_carrier, compiled, {', '.join(ENGINE_KWARGS)})")


def _run_poll() -> dict:
    """The stop poll as `accum-sched run` builds it: the config's defaults (launcher/train/trainer.py)."""
    from launcher.config.sections import DistributedConfig

    defaults = DistributedConfig()
    return {"stop_at": "micro_batch", "stop_poll_every": defaults.stop_poll_every,
            "stop_poll_min_ms": defaults.stop_poll_min_ms}


# the engine on FSDP2 or DeepSpeed: with the stop poll off (the engine's default), on as `accum-sched run` runs it
# (a 100 ms time floor), on at every micro-batch (no floor: the default before it), on every 4 micro-batches
POLL_KWARGS = {"engine": {}, "engine2": {}, "poll": _run_poll(), "poll1": {"stop_at": "micro_batch"},
               "poll4": {"stop_at": "micro_batch", "stop_poll_every": 4}}
ENGINE_KWARGS = {"engine": {}, "engine2": {}, "engine_norm": {"norm_every": 1},
                 "engine_nohook": {"count_allreduce": False}, "engine_carrier": {}, "stream": {},
                 "stream1": {"read_ahead": 1}, "stream8": {"read_ahead": 8}}


def run_epoch(variants: dict, loader, factor: int, epoch: int, batches: int, order: random.Random) -> tuple[dict, dict]:
    """One epoch of every variant, interleaved window by window in an order shuffled at every window (``order`` is
    seeded the same on every rank); (wall, cpu) seconds per variant."""
    names = list(variants)
    wall, cpu = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)

    def timed(name, call, *a):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        call(*a)
        wall[name] += time.perf_counter() - t
        cpu[name] += time.process_time() - c

    for name in names:
        variants[name].start(loader, factor, epoch)
    for start in range(0, batches, factor):
        for name in order.sample(names, len(names)):  # no variant always goes first, nor always follows another
            timed(name, variants[name].window, min(factor, batches - start))
    for name in names:
        timed(name, variants[name].finish)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1M")
    parser.add_argument("--batches", type=int, default=62)
    parser.add_argument("--factors", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--variants", default="engine,hand2")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--deepspeed", type=int, default=None, metavar="STAGE")
    parser.add_argument("--fsdp", action="store_true",
                        help=f"the engine on FSDP2 (variants {', '.join(POLL_KWARGS)})")
    parser.add_argument("--baseline", default=None, help="the variant the others are timed against (default: hand, "
                        "alone with --deepspeed, engine with --fsdp)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.deepspeed is not None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from accum_sched.backends.deepspeed import ensure_torch_extensions_dir

        ensure_torch_extensions_dir()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    factors = [int(f) for f in args.factors.split(",")]
    w = Workload(model=args.model, batches=args.batches)
    data = rank_data(w, rank)
    loader = DataLoader(TensorDataset(*data), batch_size=w.micro)
    warmup = DataLoader(TensorDataset(*(t[:2 * w.micro] for t in data)), batch_size=w.micro)
    # every round builds its variants afresh (epoch 0: a 2-micro-batch warm-up that lets DDP rebuild its buckets,
    # then one epoch per factor), in a shuffled order, so that no variant keeps one memory layout all run long
    schedule = {0: 1, **{1 + i: f for i, f in enumerate(factors)}}
    order = random.Random(0)
    wall, cpu, names = {f: {} for f in factors}, {f: {} for f in factors}, None
    every = {f: {} for f in factors}
    for _ in range(args.rounds):
        baseline, variants = build_variants(args, w, schedule, order)
        names = names or list(variants)
        run_epoch(variants, warmup, 1, 0, 2, order)
        for epoch, factor in enumerate(factors, start=1):
            epoch_wall, epoch_cpu = run_epoch(variants, loader, factor, epoch, args.batches, order)
            for name in names:
                wall[factor].setdefault(name, []).append(epoch_wall[name])
                cpu[factor].setdefault(name, []).append(epoch_cpu[name])
                poll = getattr(getattr(variants[name], "engine", None), "_stop_poll", None)
                if poll is not None:  # the poll's interval at the epoch's end (its time floor's choice)
                    every[factor].setdefault(name, []).append(poll.every)
        del variants
    for factor in factors:  # CPU seconds of both ranks: the work done, whatever the waiting for a busy machine
        for name in names:
            t = torch.tensor(cpu[factor][name], dtype=torch.float64)
            dist.all_reduce(t)
            cpu[factor][name] = t.tolist()
    if rank == 0:
        print_table(args, w, baseline, names, factors, wall, cpu, every)
    dist.destroy_process_group()


def print_table(args, w: Workload, baseline: str, names: list, factors: list, wall: dict, cpu: dict,
                every: dict) -> None:
    what = f"DeepSpeed ZeRO-{args.deepspeed}" if args.deepspeed is not None else "FSDP2" if args.fsdp else "DDP"
    print(f"model {args.model}, {what}, {args.batches} micro-batches of {w.micro} per rank per epoch, "
          f"{args.rounds - 1} rounds after a warm-up, window-interleaved; ratio = {baseline} time / variant "
          f"time; torch {torch.__version__}, {os.cpu_count()} CPUs")
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
                  f"{statistics.median(base_w):.3f} s" + (
                      f"  poll every {min(every[factor][name])}-{max(every[factor][name])}" if name in every[factor]
                      else ""), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as launcher.worker does: skip finalization, where gloo's threads may abort the process
