"""`accum-sched check CONFIG`: validate and print the schedule table. Never imports torch (login nodes)."""
from __future__ import annotations

import os
import sys

from accum_sched.planning import simulate_windows
from launcher import backends, import_path, tasks
from launcher.config import LR_SCHEDULERS, OPTIMIZERS, Config, load_config, trackers
from launcher.config.noise import adaptive_settings
from launcher.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="validate a config and print its accumulation schedule (no torch needed)")
    p.add_argument("config", help="the YAML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--batches-per-epoch", type=int, default=None, metavar="N",
                   help="micro-batches per rank per epoch, to print optimizer steps per epoch and in total")
    p.add_argument("--tokens-per-micro-batch", type=int, default=None, metavar="T",
                   help="tokens in one rank's micro-batch, to count the steps of a token-keyed schedule")
    p.set_defaults(func=main)


def cores() -> int:
    """CPU cores this process may run on (its affinity: what a container or a SLURM step grants)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def warn_oversubscribed(cfg: Config, available: int | None = None) -> bool:
    """Warn (not refuse: it still runs, slowly) when this machine starts more workers than it has cores."""
    available = cores() if available is None else available
    workers = cfg.distributed.nproc_per_node
    if workers <= available:
        return False
    print(f"warning: distributed.nproc_per_node is {workers} but this machine has {available} CPU core(s): every "
          f"worker imports torch and holds its own model, so start-up and steps are slow and memory grows with "
          f"each; set distributed.nproc_per_node to {available} or fewer (or --set it) unless this is intended",
          file=sys.stderr)
    return True


def preflight(cfg: Config, local: bool = True) -> None:
    """Everything that can be checked before any worker starts: task target (and a built-in's args), import
    paths, DeepSpeed config. ``local``: the workers start on this machine (`run`, `check`), not on SLURM's nodes,
    so more workers than its cores is worth a warning."""
    tasks.check_target(cfg.task.target)
    tasks.check_args(cfg.task.target, cfg.task.args)
    if cfg.optimizer.name not in OPTIMIZERS:
        import_path.check("optimizer.name", cfg.optimizer.name, "Lion")
    if cfg.lr_scheduler is not None and cfg.lr_scheduler.name not in LR_SCHEDULERS:
        import_path.check("lr_scheduler.name", cfg.lr_scheduler.name, "MyScheduler")
    backends.get(cfg.distributed.backend).preflight(cfg)  # e.g. the DeepSpeed JSON against the launch's world
    trackers.preflight(cfg)  # logging.wandb / logging.mlflow: the package is installed
    if local:
        warn_oversubscribed(cfg)


def main(args) -> int:
    if args.batches_per_epoch is not None and args.batches_per_epoch < 1:
        raise ConfigError("--batches-per-epoch", f"must be >= 1, got {args.batches_per_epoch}", "give a positive count")
    cfg = load_config(args.config, args.set)
    preflight(cfg)
    schedule = cfg.schedule
    print(f"config {args.config}: OK")
    print(f"task {cfg.task.target}, backend {cfg.distributed.backend}, world {cfg.world_size} "
          f"({cfg.distributed.nnodes} node(s) x {cfg.distributed.nproc_per_node}), {cfg.run.epochs} epochs")
    epochs_shown = cfg.run.epochs if schedule.unit == "epoch" else None
    print(schedule.table(cfg.data.micro_batch_size, cfg.world_size, epochs=epochs_shown,
                         batches_per_epoch=args.batches_per_epoch))
    if cfg.accumulation.adaptive is not None:  # the table shows the first windows only
        a = adaptive_settings(cfg.accumulation.adaptive)
        print(f"adaptive: the factor follows the measured noise scale within {a['min_factor']}..{a['max_factor']} "
              f"(decided every {a['every_n_steps']} optimizer steps); the table shows the start")
    if args.batches_per_epoch is None:
        print("(give --batches-per-epoch N to see optimizer steps)")
    elif schedule.unit != "epoch":
        print(_simulated_totals(cfg, schedule, args))
    return 0


def _simulated_totals(cfg: Config, schedule, args) -> str:
    """Per-epoch and total optimizer steps of a step/sample/token-keyed schedule, by replaying its windows."""
    world, micro = cfg.world_size, cfg.data.micro_batch_size
    per_step = {"samples_per_micro_step": micro * world}
    if schedule.unit == "tokens":
        if args.tokens_per_micro_batch is None:
            return "(give --tokens-per-micro-batch T to count the steps of a token-keyed schedule)"
        if args.tokens_per_micro_batch < 1:
            raise ConfigError("--tokens-per-micro-batch", f"must be >= 1, got {args.tokens_per_micro_batch}",
                              "give the tokens of one rank's micro-batch")
        per_step = {"tokens_per_micro_step": args.tokens_per_micro_batch * world}
    steps = [0] * cfg.run.epochs
    factors: list[set] = [set() for _ in range(cfg.run.epochs)]
    for epoch, factor, _ in simulate_windows(schedule, args.batches_per_epoch, cfg.run.epochs, **per_step):
        steps[epoch] += 1
        factors[epoch].add(factor)
    lines = ["epoch  factors  steps"]
    lines += [f"{e:>5}  {','.join(map(str, sorted(f))):>7}  {s:>5}" for e, (f, s) in enumerate(zip(factors, steps))]
    lines.append(f"total optimizer steps over {cfg.run.epochs} epochs: {sum(steps)}")
    return "\n".join(lines)
