"""`accum-sched slurm CONFIG`: validate, render the sbatch script, write it into the run directory and submit it.

Runs on login nodes, so it never imports torch. `--dry-run` prints the script and writes nothing.

The checkpoint policy is `accum-sched run`'s, applied before anything is queued: without --resume an earlier run's
checkpoints in the run directory are moved aside (the job starts afresh; a requeued run of it still resumes its
own checkpoints); with --resume the checkpoint must exist, be intact and match the config and world size, or the
command stops with exit 2 and nothing is submitted.
"""
from __future__ import annotations

import json
import os
import sys

from launcher.checkpoint import resume as checkpoint_resume
from launcher.checkpoint import store as checkpoint_store
from launcher.cli.check import preflight
from launcher.config import Config, load_config, write_resolved
from launcher.errors import ConfigError
from launcher.launch.slurm import TEMPLATES, SbatchError, SlurmJob, render_job, submit

SCRIPT_NAME = "job.sbatch"


def add_parser(sub) -> None:
    p = sub.add_parser("slurm", help="render an sbatch script for a config and submit it (no torch needed)")
    p.add_argument("config", help="the YAML config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--nodes", type=int, help="number of nodes (distributed.nnodes)")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="GPUs per node, one worker each (slurm.gpus_per_node and distributed.nproc_per_node)")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="workers per node without GPUs "
                                                                   "(distributed.nproc_per_node)")
    p.add_argument("--cpus-per-task", type=int, metavar="C", help="CPUs per worker process (slurm.cpus_per_worker; "
                   "the torchrun template asks for C x workers for its one task per node)")
    p.add_argument("--partition", help="slurm.partition")
    p.add_argument("--time", help="time limit, e.g. 90 (minutes), 04:00:00 or 1-00:00:00 (slurm.time)")
    p.add_argument("--account", help="slurm.account")
    p.add_argument("--job-name", help="slurm.job_name (default accum-<run directory name>)")
    p.add_argument("--signal", help="preemption warning, NAME[@SECONDS] (slurm.signal, default USR2@90)")
    p.add_argument("--template", help=f"{' or '.join(TEMPLATES)} (one task per worker), or a template file "
                                      f"(slurm.template)")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
                   help="continue from the newest valid checkpoint (auto) or a given one; without it an earlier "
                        "run's checkpoints are moved aside and the job starts afresh")
    p.add_argument("--dry-run", action="store_true", help="print the script instead of writing and submitting it")
    p.set_defaults(func=main)


def _overrides(args) -> list[str]:
    out = list(args.set)
    ints = (("nodes", "distributed.nnodes"), ("nproc_per_node", "distributed.nproc_per_node"),
            ("gpus_per_node", "slurm.gpus_per_node"), ("cpus_per_task", "slurm.cpus_per_worker"))
    out += [f"{key}={getattr(args, flag)}" for flag, key in ints if getattr(args, flag) is not None]
    if args.gpus_per_node and args.nproc_per_node is None:  # one worker per GPU (both given: checked later)
        out.append(f"distributed.nproc_per_node={args.gpus_per_node}")
    # strings are passed quoted so YAML keeps them as written (an unquoted 1:30:00 would become 5400)
    strs = (("partition", "slurm.partition"), ("time", "slurm.time"), ("account", "slurm.account"),
            ("job_name", "slurm.job_name"), ("signal", "slurm.signal"), ("template", "slurm.template"))
    out += [f"{key}={json.dumps(getattr(args, flag))}" for flag, key in strs if getattr(args, flag) is not None]
    return out


def _strings(cfg: Config, key: str) -> tuple[str, ...]:
    items = cfg.slurm.get(key)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ConfigError(f"slurm.{key}[{i}]", f"expected a string, got {item!r}", "quote the item")
    return tuple(items)


def build_job(cfg: Config, config_path: str, workdir: str, python: str, resume: str | None = None) -> SlurmJob:
    s, dist = cfg.slurm, cfg.distributed
    if dist.elastic:  # sbatch's --nodes MIN-MAX would start the job on some count and never re-form it
        raise ConfigError("distributed.nnodes", f"{dist.nnodes!r} is an elastic range; `accum-sched slurm` submits "
                          "a fixed number of nodes", "give a number of nodes here, or start `accum-sched run "
                          "--nnodes MIN:MAX` on each node of an allocation (docs/elastic.md)")
    time = s.time
    if time is not None and not isinstance(time, str):
        raise ConfigError("slurm.time", f"{time!r} is a number (YAML reads an unquoted 1:30:00 as 5400)",
                          "quote it: time: '1:30:00' (or '90' for minutes)")
    run_dir = os.path.abspath(cfg.run.output_dir)
    template = s.template if s.template in TEMPLATES else os.path.abspath(s.template)
    return SlurmJob(
        job_name=s.job_name or f"accum-{os.path.basename(run_dir.rstrip(os.sep)) or 'run'}",
        workdir=workdir, run_dir=run_dir, config=config_path, python=python, template=template,
        nodes=dist.nnodes, nproc_per_node=dist.nproc_per_node, gpus_per_node=s.gpus_per_node,
        cpus_per_worker=s.cpus_per_worker, partition=s.partition, time=time, account=s.account, signal=s.signal,
        requeue=s.requeue, max_restarts=dist.max_restarts, extra_sbatch=_strings(cfg, "extra_sbatch"),
        setup=_strings(cfg, "setup"), resume=resume)


def _hint(output: str) -> str:
    text = output.lower()
    if "command not found" in text:
        return "run this on a SLURM login node, or use --dry-run to print the script"
    if "partition" in text:
        return "check --partition (slurm.partition) against `sinfo -s`"
    if "account" in text or "association" in text:
        return "check --account (slurm.account) against `sacctmgr show assoc user=$USER`"
    if "time limit" in text:
        return "lower --time (slurm.time) to the partition's limit (`sinfo -o '%P %l'`)"
    if "node configuration" in text or "gres" in text or "cpu count" in text:
        return "ask for fewer --nodes / --gpus-per-node / --cpus-per-task (see `sinfo -N -l`)"
    return "fix the option sbatch names above (or see the script with --dry-run)"


def main(args) -> int:
    workdir = os.getcwd()
    cfg = load_config(args.config, _overrides(args))
    preflight(cfg, local=False)  # the workers run on the allocation's nodes, not here
    run_dir = os.path.abspath(cfg.run.output_dir)
    # The job may start from another directory: pin the run directory in the config the workers read.
    cfg = load_config(args.config, _overrides(args) + [f"run.output_dir={json.dumps(run_dir)}"])
    resume = args.resume if args.resume in (None, "auto") else os.path.abspath(args.resume)
    # As `run` does, before queueing: a damaged checkpoint, another config or world size is an error now, not on
    # the compute node after the job waited in the queue.
    checkpoint_resume.preflight(cfg, resume)
    config_path = os.path.join(run_dir, "config.yaml")
    job = build_job(cfg, config_path, workdir, sys.executable, resume)
    script = render_job(job)
    if args.dry_run:
        sys.stdout.write(script)
        return 0

    os.makedirs(run_dir, exist_ok=True)
    write_resolved(cfg, config_path)
    script_path = os.path.join(run_dir, SCRIPT_NAME)
    tmp = f"{script_path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(script)
    os.chmod(tmp, 0o755)
    os.replace(tmp, script_path)
    # A fresh job must not find the earlier run's checkpoints (its requeued runs resume whatever is newest).
    root = os.path.abspath(checkpoint_store.checkpoint_root(cfg))
    moved = None if resume else checkpoint_store.supersede(root)
    try:
        job_id = submit(script_path)
    except SbatchError as err:
        if moved is not None:  # nothing was queued: put them back
            checkpoint_store.unsupersede(root, moved[0])
        print(err.output, file=sys.stderr)  # sbatch's own words, verbatim
        print(f"error: sbatch failed (exit {err.returncode}) for {script_path}; {_hint(err.output)}", file=sys.stderr)
        return 2
    if moved is not None:
        print(f"accum-sched: starting afresh: moved {len(moved[1])} checkpoint(s) of an earlier run to {moved[0]} "
              f"(submit with --resume to continue a run)", file=sys.stderr)
    print(f"submitted batch job {job_id}: {script_path}; log {os.path.join(run_dir, f'slurm-{job_id}.out')}",
          flush=True)
    return 0
