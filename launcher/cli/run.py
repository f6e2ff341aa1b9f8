"""`accum-sched run CONFIG`: validate, write the resolved config, start the workers through torchrun.

Exit status: torchrun's (0 when training completed); 2 for a bad config (nothing launched); 75 when a SIGTERM
stopped the run and the workers committed a checkpoint first (continue with --resume; launcher/launch/forward.py);
130 when a SIGINT (Ctrl-C) did the same."""
from __future__ import annotations

import os
import signal
import sys
import time

from launcher.checkpoint import resume as checkpoint_resume
from launcher.checkpoint import store
from launcher.cli.check import preflight
from launcher.config import LR_SCHEDULERS, OPTIMIZERS, load_config, write_resolved
from launcher.errors import ConfigError
from launcher.launch import env as launch_env
from launcher.launch import failures, forward, malloc, rundir
from launcher.launch.torchrun import LaunchPlan, check_endpoint, elastic_env, run_id, torchrun_argv
from launcher.train import data_size


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="validate a config and train with torchrun (one node or many)")
    p.add_argument("config", help="the YAML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--nproc-per-node", type=int, default=None, help="workers per node (distributed.nproc_per_node)")
    p.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="number of nodes, or MIN:MAX for an elastic run (distributed.nnodes; docs/elastic.md)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="c10d rendezvous of a multi-node run")
    p.add_argument("--max-restarts", type=int, default=None, help="torchrun restarts of a failed worker group")
    p.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                   help="torchrun's rendezvous settings, e.g. last_call_timeout=5 (elastic runs; docs/elastic.md)")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
                   help="continue from the newest valid checkpoint (auto) or a given one")
    p.set_defaults(func=main)


def check_devices(cfg) -> None:
    """GPU settings this node cannot honour stop here with exit 2 (launcher/launch/env.py: check_devices); gloo on a GPU
    machine only warns. The driver and CUDA_VISIBLE_DEVICES answer without torch where they can (no GPU here, or
    gloo, which only warns); torch's own view is imported (about 3 s) only for auto or nccl on a machine with GPUs,
    or where only torch can count them (ROCm, GPUs named by UUID)."""
    count = launch_env.gpus_without_torch(os.environ)
    if count is None or (count > 0 and cfg.distributed.process_group != "gloo"):
        import torch  # about 3 s, and only where only torch can count the GPUs (login nodes have none)

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    warning = launch_env.check_devices(cfg.distributed.process_group, cfg.distributed.nproc_per_node, count)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def main(args) -> int:
    overrides = list(args.set)
    for flag, key in (("nproc_per_node", "distributed.nproc_per_node"), ("nnodes", "distributed.nnodes"),
                      ("max_restarts", "distributed.max_restarts")):
        value = getattr(args, flag)
        if value is not None:  # quoted: YAML would read an unquoted 1:3 as the base-60 int 63
            overrides.append(f'{key}="{value}"' if ":" in str(value) else f"{key}={value}")
    cfg = load_config(args.config, overrides)
    dist = cfg.distributed
    if dist.elastic:
        return _run_elastic(args, cfg)
    if dist.nnodes > 1 and not args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint", f"is required with {dist.nnodes} nodes",
                          "give HOST:PORT of the first node, the same on every node")
    if args.rdzv_endpoint and ":" not in args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint", f"{args.rdzv_endpoint!r} is not HOST:PORT", "write e.g. node01:29400")
    if args.rdzv_endpoint:
        check_endpoint(args.rdzv_endpoint, dist.nnodes, args.node_rank)  # a port taken here: torchrun would wait
    if args.node_rank is not None and not 0 <= args.node_rank < dist.nnodes:
        raise ConfigError("--node-rank", f"{args.node_rank} is outside 0..{dist.nnodes - 1}", "number nodes from 0")
    rundir.check_dirs(cfg)  # a file where run.output_dir or checkpoint.dir should be: exit 2, nothing written
    preflight(cfg)
    data_size.check_builtin(cfg)  # a built-in task's dataset without one micro-batch per rank: exit 2 here
    if not _plain_optimizer(cfg):
        from launcher.train.optim import check_config  # imports torch: only when there is a name to check

        check_config(cfg)
    check_devices(cfg)  # before anything is written: a setting this node cannot honour leaves no run directory
    # one run per output_dir, held until this command (and torchrun, which inherits it) ends; before the resume
    # preflight, which may move an earlier run's checkpoints aside
    rundir.hold(cfg.run.output_dir, dist.nnodes, args.node_rank)
    checkpoint_resume.preflight(cfg, args.resume)  # damaged checkpoint, other config or world size: exit 2 here

    run_dir = cfg.run.output_dir
    os.makedirs(run_dir, exist_ok=True)
    config_path = os.path.abspath(os.path.join(run_dir, "config.yaml"))
    write_resolved(cfg, config_path)
    worker_args = ["--config", config_path]
    if args.resume:
        worker_args += ["--resume", args.resume]
    plan = LaunchPlan(nproc_per_node=dist.nproc_per_node, nnodes=dist.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=run_id(os.path.abspath(run_dir)),
                      max_restarts=dist.max_restarts)
    env = malloc.worker_env(os.environ)  # host allocator settings (launcher/launch/malloc.py: RSS under FSDP2)
    # torchrun would set 1 thread per worker with a warning; share the cores out instead, unless the user chose.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // dist.nproc_per_node)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    began = time.time()
    status, signals = forward.call(torchrun_argv(plan, worker_args), env)
    failed = failures.first(run_dir, began) if status != 0 and not signals else None
    if failed and not failed.get("shown"):  # the cause among every rank's tracebacks above
        print(f"error: rank {failed['rank']} failed first: {failed['error']}; every rank stopped (tracebacks "
              f"above): fix the cause, then `accum-sched run {args.config} --resume` continues from the last "
              "checkpoint", file=sys.stderr)
    if failed and failed.get("shown"):  # a worker found bad input (ConfigError, UnsafePickle) and said it in one line
        return 2
    if signals and status == 0 and not _completed_since(run_dir, began):
        # SIGINT (Ctrl-C) ends with the shell's 130, SIGTERM with 75 (EX_TEMPFAIL); both committed the open window
        code = forward.INTERRUPTED_STATUS if signal.SIGINT in signals else forward.PREEMPTED_STATUS
        print(f"accum-sched: stopped by signal {signals[0]}: checkpoint committed; continue with "
              f"`accum-sched run {args.config} --resume` (exit {code})", file=sys.stderr)
        return code
    return status


def _run_elastic(args, cfg) -> int:
    """An elastic run: this node's torchrun agent joins the others at --rdzv-endpoint; the group re-forms when a
    node is lost or joins, and each new group continues from the newest checkpoint (docs/elastic.md)."""
    dist = cfg.distributed
    if not args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint", f"is required for an elastic run (distributed.nnodes {dist.nnodes!r})",
                          "give HOST:PORT of a node that stays for the whole run, the same on every node")
    if ":" not in args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint", f"{args.rdzv_endpoint!r} is not HOST:PORT", "write e.g. node01:29400")
    if args.node_rank is not None:
        raise ConfigError("--node-rank", "is not used by an elastic run: the rendezvous numbers the nodes",
                          "leave --node-rank out")
    if args.resume not in (None, "auto"):
        raise ConfigError("--resume", f"{args.resume!r}: an elastic run continues from the newest checkpoint of "
                          "its directory, every time its group re-forms", "use --resume auto, or none")
    check_endpoint(args.rdzv_endpoint, 2)  # another agent of this job may serve it here already
    if dist.max_restarts == 0:
        print("warning: distributed.max_restarts is 0: a lost node ends this elastic run (a node that joins "
              "costs no restart); give --max-restarts K to survive K losses", file=sys.stderr)
    rundir.check_dirs(cfg)
    preflight(cfg)
    data_size.check_builtin(cfg)  # with the most ranks the run may have
    if not _plain_optimizer(cfg):
        from launcher.train.optim import check_config  # imports torch: only when there is a name to check

        check_config(cfg)
    check_devices(cfg)
    rdzv_id = run_id(f"{os.path.abspath(cfg.run.output_dir)}@{args.rdzv_endpoint}")
    run_dir = cfg.run.output_dir
    config_path = os.path.abspath(os.path.join(run_dir, "config.yaml"))

    def start():  # the first agent in, before any other may join: the agents that join find the run started
        if args.resume:  # intact and of this config; the world size is the groups' to check, once formed
            found = store.find(os.path.abspath(store.checkpoint_root(cfg)), "auto")
            if found is not None:
                checkpoint_resume.check_config(*found, cfg)
        else:
            _start_afresh(cfg)
        write_resolved(cfg, config_path)

    rundir.hold_elastic(run_dir, f"{args.rdzv_endpoint} {rdzv_id}", on_first=start)
    if not os.path.exists(config_path):
        write_resolved(cfg, config_path)
    plan = LaunchPlan(nproc_per_node=dist.nproc_per_node, nnodes=dist.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                      rdzv_id=rdzv_id, max_restarts=dist.max_restarts, rdzv_conf=args.rdzv_conf)
    env = elastic_env(malloc.worker_env(os.environ))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // dist.nproc_per_node)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    began = time.time()
    status, signals = forward.call(torchrun_argv(plan, ["--config", config_path]), env)
    failed = failures.first(run_dir, began, newest=True) if not signals else None  # the last group's
    if failed and failed.get("shown") and not _completed_since(run_dir, began):
        # bad input every rank found (a factor that does not come out whole on the new world size): the workers
        # ended quietly (launcher/worker.py), every node says it here
        print(f"error: {failed['error'].partition(': ')[2] or failed['error']}", file=sys.stderr)
        return 2
    failed = failures.first(run_dir, began) if status != 0 and not signals else None
    if failed:
        print(f"error: rank {failed['rank']} failed first: {failed['error']}; this node's agent stopped after "
              f"its restarts (distributed.max_restarts {dist.max_restarts}): fix the cause, then "
              f"`accum-sched run {args.config} --nnodes {dist.nnodes} --rdzv-endpoint {args.rdzv_endpoint} "
              "--resume auto` continues from the last checkpoint", file=sys.stderr)
    return status


def _start_afresh(cfg) -> None:
    """The first agent of an elastic run started without --resume: an earlier run's checkpoints and metrics go
    aside now, before any worker starts, since every worker continues from the newest checkpoint it finds."""
    moved = store.supersede(os.path.abspath(store.checkpoint_root(cfg)))
    if moved is not None:
        print(f"starting afresh: moved {len(moved[1])} checkpoint(s) of an earlier run to {moved[0]} (run with "
              "--resume auto to continue a run)", file=sys.stderr)
    store.rewind_metrics(cfg.run.output_dir, 0)


def _completed_since(run_dir: str, began: float) -> bool:
    """The workers wrote summary.json during this launch: the run finished (a stop leaves none)."""
    path = os.path.join(run_dir, "summary.json")
    return os.path.exists(path) and os.path.getmtime(path) >= began - 1


def _plain_optimizer(cfg) -> bool:
    """A built-in optimizer and LR scheduler without extra keywords: nothing to import before launch."""
    sched = cfg.lr_scheduler
    return (cfg.optimizer.name in OPTIMIZERS and not cfg.optimizer.args
            and (sched is None or (sched.name in LR_SCHEDULERS and not sched.args)))


if __name__ == "__main__":
    sys.exit(main(None))
