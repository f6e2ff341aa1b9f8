"""Whether a dataset gives every rank at least one micro-batch an epoch (issue 37, fault 4). Torch-free: the
workers check the dataset they built (launcher/train/trainer.py), and `accum-sched run` checks a built-in task
whose size its arguments give before anything is launched (launcher/cli/run.py).

Without one micro-batch per rank an epoch trains nothing: the run would log no step and then fail while writing
its summary, after writing model.pt. The sizes follow DistributedSampler (drop_last False: each rank gets
ceil(samples / world) samples, padded) and the DataLoader (data.drop_last drops a short last micro-batch). Under
``data.sampler: invariant`` every rank has ``factor`` micro-batches in every window however few samples the epoch
has (short or empty ones: accum_sched.invariant), so only an empty dataset trains nothing.
"""
from __future__ import annotations

import math

from launcher.errors import ConfigError


def too_small(target: str, samples: int, world: int, micro: int, drop_last: bool,
              sampler: str = "distributed") -> ConfigError | None:
    """The one-line refusal for a dataset of ``samples`` over ``world`` ranks at micro-batch ``micro``, or None."""
    if samples == 0:
        return ConfigError("task", f"the dataset of {target} has 0 samples: nothing to train on",
                           "give the task samples (e.g. --set task.args.samples=N)")
    if sampler == "invariant":
        return None
    per_rank = math.ceil(samples / world)
    if drop_last and per_rank < micro:
        return ConfigError("data.micro_batch_size", f"is {micro}, but the dataset's {samples} samples give each of "
                           f"the {world} rank(s) {per_rank}: not one micro-batch per rank with data.drop_last: true",
                           f"lower data.micro_batch_size to at most {per_rank}, set data.drop_last: false, or give "
                           "the task more samples")
    return None


def check_builtin(cfg) -> None:
    """Before launch: builtin:regression with ``samples`` given, whose dataset size is that number."""
    samples = cfg.task.args.get("samples") if isinstance(cfg.task.args, dict) else None
    if cfg.task.target != "builtin:regression" or not isinstance(samples, int) or samples < 0:
        return
    err = too_small(cfg.task.target, samples, cfg.world_size, cfg.data.micro_batch_size, cfg.data.drop_last,
                    cfg.data.sampler)
    if err is not None:
        raise err
