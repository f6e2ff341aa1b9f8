"""`accum-sched check CONFIG`: validate and print the schedule table. Never imports torch (login nodes)."""
from __future__ import annotations

from launcher import tasks
from launcher.config import Config, load_config
from launcher.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="validate a config and print its accumulation schedule (no torch needed)")
    p.add_argument("config", help="the YAML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--batches-per-epoch", type=int, default=None, metavar="N",
                   help="micro-batches per rank per epoch, to print optimizer steps per epoch and in total")
    p.set_defaults(func=main)


def preflight(cfg: Config) -> None:
    """Everything that can be checked before any worker starts: task target, DeepSpeed config."""
    tasks.check_target(cfg.task.target)
    if cfg.distributed.backend == "deepspeed":
        from launcher import deepspeed_setup  # no torch/deepspeed import at module level there either

        deepspeed_setup.validate(cfg, cfg.world_size)


def main(args) -> int:
    if args.batches_per_epoch is not None and args.batches_per_epoch < 1:
        raise ConfigError("--batches-per-epoch", f"must be >= 1, got {args.batches_per_epoch}", "give a positive count")
    cfg = load_config(args.config, args.set)
    preflight(cfg)
    schedule = cfg.schedule
    print(f"config {args.config}: OK")
    print(f"task {cfg.task.target}, backend {cfg.distributed.backend}, world {cfg.world_size} "
          f"({cfg.distributed.nnodes} node(s) x {cfg.distributed.nproc_per_node}), {cfg.run.epochs} epochs")
    print(schedule.table(cfg.data.micro_batch_size, cfg.world_size, epochs=cfg.run.epochs,
                         batches_per_epoch=args.batches_per_epoch))
    if args.batches_per_epoch is None:
        print("(give --batches-per-epoch N to see optimizer steps)")
    return 0
