"""`accum-sched cbs CONFIG --from CHECKPOINT --factors 1,2,4,8 --samples N`: probe the critical batch size.

The branched method of Merrill et al. 2025 (arXiv 2505.23971): from one checkpoint, one short run per factor over
the same next ``N`` samples, then compare the losses they reach. The largest factor whose loss is within
``--tolerance`` (relative) of the best is the critical one: a larger batch there costs no loss per sample, only fewer
optimizer steps.

Each branch is a normal `accum-sched run` of CONFIG in ``OUT/factor-F`` resumed from CHECKPOINT (same world size)
with: the factor F from the checkpoint's step on (``unit: step``, schedule ``{0: F0, S: F}`` with F0 the factor the
checkpoint was taken at, so ``co_scale``/``lr_coupling`` scale the LR by F / F0 as configured), the learning rate
held at the checkpoint's (the LR scheduler set to constant: a decaying schedule would decay differently over each
branch's number of steps), ``run.max_steps`` where N samples are read, and ``checkpoint.force_resume`` (the
schedule differs on purpose). A branch that stopped is resumed from its own checkpoints the next time; a finished
one is read again, not rerun. The loss a branch reached: its last evaluation's ``val_loss`` when the task has a
validation set, else the sample-weighted mean training loss over its last quarter of samples.

Writes ``OUT/cbs.json`` and ``OUT/cbs.png`` (with matplotlib); ``--apply`` also writes ``OUT/schedule.yaml``, the
accumulation section of a next run that trains at F0 up to step S and at the critical factor from there.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from launcher import tasks
from launcher.checkpoint import pickle_scan
from launcher.checkpoint import resume as checkpoint_resume
from launcher.config import load_config
from launcher.errors import ConfigError
from launcher.train.schedule_from import batches_per_rank


def add_parser(sub) -> None:
    p = sub.add_parser("cbs", help="branch short runs per factor from a checkpoint: the critical batch size")
    p.add_argument("config", help="the YAML config of the run the checkpoint belongs to")
    p.add_argument("--from", dest="checkpoint", required=True, metavar="CHECKPOINT", help="checkpoint directory")
    p.add_argument("--factors", default="1,2,4,8", help="comma-separated factors to branch with (default 1,2,4,8)")
    p.add_argument("--samples", type=int, required=True, metavar="N", help="samples every branch trains on")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="relative loss gap to the best that still counts as as good (default 0.01)")
    p.add_argument("--out", default=None, help="where the branches go (default OUTPUT_DIR/cbs)")
    p.add_argument("--apply", action="store_true", help="write OUT/schedule.yaml for the next run")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--allow-low-lr", action="store_true",
                   help="probe a checkpoint whose LR is below a tenth of the run's peak (refused otherwise)")
    p.set_defaults(func=main)


LOW_LR = 0.1  # a checkpoint's LR below this fraction of the run's peak: every factor moves the loss by ~nothing


def parse_factors(text: str) -> list[int]:
    try:
        factors = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        factors = []
    if not factors or factors[0] < 1:
        raise ConfigError("--factors", f"{text!r} is not a list of integers >= 1", "write e.g. --factors 1,2,4,8")
    return factors


def checkpoint_position(cfg, path: str):
    """(path, manifest, F0, LR): the checkpoint, the factor its run had at that step (its metrics.jsonl) and the
    optimizer's learning rate there."""
    plan = checkpoint_resume.plan_resume(cfg, cfg.world_size, path)
    manifest = plan.manifest
    if manifest.partial_window:
        raise ConfigError("--from", f"{path} was taken inside a window", "branch from a checkpoint at a step boundary")
    metrics = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(plan.path))), "metrics.jsonl")
    factor, lr, peak = 1, None, cfg.optimizer.lr
    if os.path.exists(metrics):
        with open(metrics, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record.get("step") == manifest.step:
                    factor, lr = int(record["factor"]), record.get("lr")
                if record.get("lr") is not None:
                    peak = max(peak, float(record["lr"]))
    return plan.path, manifest, factor, checkpoint_lr(plan.path, lr, cfg.optimizer.lr), peak


def refuse_low_lr(lr: float, peak: float, step: int) -> None:
    """At a tenth of the peak LR or less the branches barely move and every factor lands within the tolerance,
    so the largest would be called critical on noise."""
    if lr < LOW_LR * peak:
        raise ConfigError("--from", f"the checkpoint's learning rate at step {step} is {lr:.3g}, below a tenth of "
                          f"the run's peak {peak:.3g}: every factor would reach about the same loss",
                          "branch from an earlier checkpoint, or pass --allow-low-lr to probe it anyway")


def steps_for(samples: int, factor: int, manifest, per_rank: int, micro: int, world: int, epochs: int) -> int:
    """Optimizer steps at ``factor`` from the checkpoint's position until ``samples`` samples are read."""
    batches = math.ceil(per_rank / micro)
    epoch, index, read, steps = manifest.epoch, manifest.micro_batch, 0, 0
    while read < samples:
        if index >= batches:
            epoch, index = epoch + 1, 0
        if epoch >= epochs:
            raise ConfigError("--samples", f"{samples} samples are more than the run has left after the checkpoint "
                              f"(at factor {factor})", "lower --samples or raise run.epochs")
        size = min(factor, batches - index)
        read += sum(world * min(micro, per_rank - i * micro) for i in range(index, index + size))
        index, steps = index + size, steps + 1
    return steps


def checkpoint_lr(checkpoint: str, metrics_lr: float | None, fallback: float) -> float:
    """The learning rate the optimizer holds at the checkpoint (its first param group in trainer.pt; the
    checkpoint step's metrics line where a back end keeps the optimizer in its own shards)."""
    import torch  # only this command's worker-free steps need it: the CLI loads this module on login nodes

    path = os.path.join(checkpoint, "trainer.pt")
    pickle_scan.check_state_file(path)  # a planted or foreign pickle: the one line `run` gives, exit 2
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # never torch's advice to load it without weights_only
        raise pickle_scan.refusal(path, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}") from exc
    optimizer = state.get("optimizer")
    if optimizer and optimizer.get("param_groups"):
        return float(optimizer["param_groups"][0]["lr"])
    return fallback if metrics_lr is None else float(metrics_lr)


def branch_argv(args, cfg, out: str, factor: int, factor0: int, step: int, steps: int, checkpoint: str,
                lr: float) -> list:
    run_dir = os.path.join(out, f"factor-{factor}")
    sets = list(args.set) + [f"run.output_dir={run_dir}", "accumulation.unit=step",
                             f"accumulation.schedule={{0: {factor0}, {step}: {factor}}}",
                             f"run.max_steps={step + steps}", "checkpoint.force_resume=true"]
    if cfg.accumulation.global_batch is not None:
        sets.append("accumulation.global_batch=null")
    if cfg.lr_scheduler is not None:  # held: the optimizer's LR at the checkpoint, as the branch's base LR
        sets += ["lr_scheduler.name=constant", "lr_scheduler.warmup_steps=0", "lr_scheduler.args={}",
                 f"optimizer.lr={lr!r}"]
    own = os.path.join(run_dir, "checkpoints")
    resume = "auto" if os.path.isdir(own) and os.listdir(own) else checkpoint
    argv = [sys.executable, "-m", "launcher", "run", args.config, "--resume", resume]
    for item in sets:
        argv += ["--set", item]
    return argv


def reached_loss(run_dir: str) -> float:
    """The branch's last val_loss, else its mean training loss over the last quarter of its samples."""
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    last = summary.get("last_eval") or {}
    if isinstance(last, dict) and last.get("val_loss") is not None:
        return float(last["val_loss"])
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    total = sum(m["samples"] for m in lines)
    kept, seen = [], 0
    for m in reversed(lines):
        kept.append(m)
        seen += m["samples"]
        if seen >= total / 4:
            break
    return sum(m["loss"] * m["samples"] for m in kept) / sum(m["samples"] for m in kept)


def critical(results: list[dict], tolerance: float) -> int:
    best = min(r["loss"] for r in results)
    return max(r["factor"] for r in results if r["loss"] <= best + abs(best) * tolerance)


def main(args) -> int:
    cfg = load_config(args.config, list(args.set))
    factors = parse_factors(args.factors)
    if args.samples < 1:
        raise ConfigError("--samples", f"{args.samples} is not >= 1", "give the samples each branch trains on")
    checkpoint, manifest, factor0, lr, peak = checkpoint_position(cfg, args.checkpoint)
    if not args.allow_low_lr:
        refuse_low_lr(lr, peak, manifest.step)
    elif lr < LOW_LR * peak:
        print(f"accum-sched cbs: WARNING: probing at LR {lr:.3g}, below a tenth of the run's peak {peak:.3g} "
              f"(--allow-low-lr): the factors' losses may differ by noise only", file=sys.stderr, flush=True)
    out = os.path.abspath(args.out or os.path.join(cfg.run.output_dir, "cbs"))
    world, micro = cfg.world_size, cfg.data.micro_batch_size
    per_rank, _ = batches_per_rank(len(tasks.build(cfg.task.target, cfg.task.args).dataset), world, micro, False)
    results = []
    for factor in factors:
        steps = steps_for(args.samples, factor, manifest, per_rank, micro, world, cfg.run.epochs)
        run_dir = os.path.join(out, f"factor-{factor}")
        if not os.path.exists(os.path.join(run_dir, "summary.json")):
            print(f"accum-sched cbs: factor {factor}: {steps} steps from step {manifest.step} (steps "
                  f"{manifest.step + 1}-{manifest.step + steps}, {args.samples} samples) in {run_dir}", flush=True)
            done = subprocess.run(branch_argv(args, cfg, out, factor, factor0, manifest.step, steps, checkpoint,
                                              lr))
            if done.returncode != 0:
                print(f"accum-sched cbs: the factor-{factor} branch failed (exit {done.returncode}); rerun the same "
                      f"command to resume it", file=sys.stderr)
                return done.returncode
        results.append({"factor": factor, "steps": steps, "loss": reached_loss(run_dir), "dir": run_dir})
    pick = critical(results, args.tolerance)
    report = {"checkpoint": checkpoint, "step": manifest.step, "factor_at_checkpoint": factor0,
              "lr_at_checkpoint": lr, "peak_lr": peak,
              "samples": args.samples, "tolerance": args.tolerance, "branches": results, "critical_factor": pick}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cbs.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    _print_table(report)
    _plot(report, os.path.join(out, "cbs.png"))
    if args.apply and pick == factor0:  # {0: F0, S: F0} would train exactly as the run already does
        print(f"accum-sched cbs: nothing to apply: the critical factor {pick} is the factor the run has at step "
              f"{manifest.step}; no schedule.yaml written")
    elif args.apply:
        path = os.path.join(out, "schedule.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"# accum-sched cbs: factor {factor0} up to step {manifest.step}, then the critical factor {pick}\n"
                    f"accumulation:\n  unit: step\n  schedule: {{0: {factor0}, {manifest.step}: {pick}}}\n")
        print(f"accum-sched cbs: wrote {path}; use it with --set accumulation.unit=step "
              f"--set 'accumulation.schedule={{0: {factor0}, {manifest.step}: {pick}}}'")
    return 0


def _print_table(report: dict) -> None:
    best = min(b["loss"] for b in report["branches"])
    print(f"{'factor':>6}  {'steps':>6}  {'loss':>9}  {'vs best':>8}")
    for b in report["branches"]:
        mark = "  <- critical" if b["factor"] == report["critical_factor"] else ""
        print(f"{b['factor']:>6}  {b['steps']:>6}  {b['loss']:>9.5f}  {(b['loss'] - best) / abs(best):>+8.2%}{mark}")
    print(f"critical factor: {report['critical_factor']} (largest within {report['tolerance']:.1%} of the best loss, "
          f"{report['samples']} samples from step {report['step']})")


def _plot(report: dict, path: str) -> None:
    try:
        import matplotlib  # optional: the plot is skipped without it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional, as above
    except ImportError:
        return
    fig = figure(report, plt)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(report: dict, plt):
    """Each factor's loss as its gap to the best in percent, next to the tolerance: the question the plot answers.
    Raw losses 1e-7 apart drew an axis offset (``1e-7 + 1.177e-1``) that made a nothing look large."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    best = min(b["loss"] for b in report["branches"])
    xs = [b["factor"] for b in report["branches"]]
    ax.plot(xs, [100 * (b["loss"] - best) / abs(best) for b in report["branches"]], "o-")
    ax.axhline(100 * report["tolerance"], color="tab:red", linestyle=":", label=f"tolerance {report['tolerance']:.1%}")
    ax.axvline(report["critical_factor"], color="grey", linestyle="--", label="critical factor")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_xlabel("accumulation factor")
    ax.set_ylabel(f"loss above the best ({best:.4g}), %")
    ax.set_title(f"{report['samples']} samples from step {report['step']}")
    ax.legend()
    fig.tight_layout()
    return fig
