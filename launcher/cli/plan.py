"""`accum-sched plan CONFIG`: the factor and LR per optimizer-step range before launch.

For ``accumulation.schedule_from`` it shows the converted schedule (its LR schedule's decay turned into batch growth,
docs/batch-size.md); for a written schedule, the factor per step range at the configured LR. It builds the task's
dataset to know its length (so it imports torch, unlike `check`)."""
from __future__ import annotations

from launcher import tasks
from launcher.config import load_config
from launcher.errors import ConfigError
from launcher.train import schedule_from
from launcher.train.schedule_from import batches_per_rank


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print the factor and LR per optimizer-step range of a config")
    p.add_argument("config", help="the YAML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.set_defaults(func=main)


def main(args) -> int:
    cfg = load_config(args.config, list(args.set))
    from launcher.train import streams  # imports torch: the CLI loads this module on login nodes

    task = tasks.build(cfg.task.target, cfg.task.args)
    if streams.is_stream(task.dataset):
        raise ConfigError("task.target", "gives a stream, whose length (and so its plan) is not known ahead",
                          "plan a map-style dataset, or read the factors from metrics.jsonl")
    world, micro = cfg.world_size, cfg.data.micro_batch_size
    if cfg.accumulation.schedule_from is not None:
        converted = schedule_from.convert(cfg, len(task.dataset), world)
        lines = schedule_from.describe(converted, cfg.optimizer.lr, micro, world)
    else:
        lines = _written(cfg, len(task.dataset), world)
    print(f"accum-sched plan: {cfg.run.epochs} epochs, world {world}, micro-batch {micro}")
    print("\n".join(lines))
    return 0


def _written(cfg, samples: int, world: int) -> list[str]:
    """A written schedule (epoch unit) per epoch range: steps it takes, factor and effective batch."""
    schedule = cfg.schedule_for(world)
    if schedule.unit != "epoch":
        return [f"schedule ({schedule.unit}) {schedule.to_dict()}: the factor per step range is planned for epoch "
                f"units and schedule_from only"]
    _, batches = batches_per_rank(samples, world, cfg.data.micro_batch_size, cfg.data.drop_last)
    lines, step = [f"{'epochs':>9}  {'steps':>11}  {'factor':>6}  {'eff.batch':>9}"], 0
    for first, last, factor in schedule.ranges(cfg.run.epochs):
        steps = schedule.optimizer_steps(batches, last + 1) - schedule.optimizer_steps(batches, first)
        lines.append(f"{f'{first}-{last}':>9}  {f'{step + 1}-{step + steps}':>11}  {factor:>6}  "
                     f"{factor * cfg.data.micro_batch_size * world:>9}")
        step += steps
    lines.append(f"{step} optimizer steps")
    return lines
