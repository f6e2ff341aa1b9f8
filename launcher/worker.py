"""The per-rank entry point: `python -m launcher.worker --config RUN_DIR/config.yaml`.

torchrun runs it (and srun, and the `deepspeed` launcher, which adds --local_rank). It reads the resolved config,
joins the process group, builds the trainer (launcher/train/trainer.py) and trains; rank 0 leaves model.pt,
metrics.jsonl and summary.json.
"""
from __future__ import annotations

import os

from launcher.launch.forward import guard_worker

if __name__ == "__main__" and os.environ.get("TORCHELASTIC_RUN_ID"):
    # started by torchrun: never outlive it, not even while torch is imported below (seconds); a torchrun already
    # gone ends this process here (launcher/launch/forward.py: guard_worker)
    guard_worker()

import argparse  # noqa: E402 -- after the guard: nothing slow may come before it
import gc  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record

from launcher.checkpoint.pickle_scan import UnsafePickle  # noqa: E402
from launcher.config import load_config  # noqa: E402
from launcher.errors import ConfigError  # noqa: E402
from launcher.launch import failures  # noqa: E402
from launcher.launch.env import as_torch_env  # noqa: E402
from launcher.launch.forward import PREEMPTED_STATUS  # noqa: E402
from launcher.launch.torchrun import ELASTIC_ENV  # noqa: E402
from launcher.train import warning_lines  # noqa: E402
from launcher.train.preempt import Preemption  # noqa: E402
from launcher.train.trainer import Trainer, detect_launch, init_distributed  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m launcher.worker")
    parser.add_argument("--config", required=True, help="the resolved config.yaml of the run")
    parser.add_argument("--resume", default=None, help="'auto' or a checkpoint path")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@record
def main(argv=None) -> int:
    args = parse_args(argv)
    warning_lines.install()  # the engine's and everyone's warnings on one line, without their source line
    # First thing: SLURM's preemption warning may come while the task and model are still being built. SIGINT
    # (Ctrl-C, forwarded by `accum-sched run`) is a stop like SIGTERM: commit the open window, exit 0.
    preemption = Preemption.install(also=(signal.SIGTERM, signal.SIGINT))
    cfg = load_config(args.config)
    device = join(cfg)
    try:
        trainer = Trainer(cfg, device, args.resume)
        preemption.attach(trainer.engine.request_stop)
        trainer.fit()
    except ConfigError as err:  # bad input found once the task and its classes are imported: one line, exit 2
        rank = int(os.environ.get("RANK", "0"))
        failures.note(cfg.run.output_dir, rank, err, shown=True)
        every_rank = getattr(err, "every_rank", False)
        if every_rank and os.environ.get(ELASTIC_ENV) == "1":
            # an elastic run: every new group would find it again, and torchrun restarts a group that fails (a
            # SIGTERM to it prints a traceback). Exit 0 so that every agent ends quietly; each node's
            # `accum-sched run` then says the line from the note and exits 2 (launcher/cli/run.py)
            return 0
        if rank == 0 or not every_rank:  # an error every rank finds: said once
            print(f"error: {err.line()}", file=sys.stderr, flush=True)
        return 2
    except UnsafePickle as err:  # a checkpoint file that would import code (launcher/checkpoint/pickle_scan.py)
        failures.note(cfg.run.output_dir, int(os.environ.get("RANK", "0")), err, shown=True)  # the others may not
        sys.stderr.write(f"error: {err}\n")  # one write: every rank says it, and the lines must not interleave
        sys.stderr.flush()
        return 2
    except Exception as err:  # every rank stops; `accum-sched run` names the one that failed first
        failures.note(cfg.run.output_dir, int(os.environ.get("RANK", "0")), err)
        raise
    # An elastic run's stop is a membership change: an agent stops its own workers (SIGTERM) to re-form the group,
    # and the stop poll carries that stop to every rank, often before the other agents have seen the change. A
    # worker stopped so must not exit 0: its agent would take the group for finished, wait at the exit barrier and
    # leave the new round without it (seen in a CI run under load). Non-zero, the agent restarts it into the new
    # round (one of --max-restarts); an agent that stopped its workers itself ignores their status.
    status = PREEMPTED_STATUS if trainer.preempted and os.environ.get(ELASTIC_ENV) == "1" else 0
    del trainer  # first: tear_down collects it
    tear_down()
    return status


def join(cfg):
    """This process's place in the run: torch's variables from SLURM's, quiet non-zero ranks, the process group
    and this rank's device."""
    launch = detect_launch()
    if launch.source != "single":
        # srun's tasks (the per_task template) carry only SLURM_* variables; DeepSpeed and torch read these.
        os.environ.update(as_torch_env(launch))
    if launch.rank != 0:  # other ranks stay quiet unless something fails
        warnings.filterwarnings("ignore")
        logging.getLogger("accum_sched").setLevel(logging.ERROR)
    return init_distributed(cfg, launch)


def tear_down() -> None:
    """Tear down in order while the interpreter is fully alive (after a success, the trainer's last reference gone).

    DDP (and DeepSpeed) hold the process group and our comm hook, and the trainer sits in a reference cycle with its
    engine's callback, so without an explicit collection they would die during interpreter finalization, where a
    gloo group's threads can abort the process ("terminate called without an active exception", seen rarely under
    load). On a failure we raise instead: destroying a group other ranks still use can hang, and torchrun stops
    them anyway."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Outputs are written and closed and the group is gone; skip interpreter finalization and its C++ destructor
    # races altogether (the exit status is what torchrun reads).
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
