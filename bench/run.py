"""Benchmark: the accum_sched engine next to what users would pick instead, on 2 gloo ranks, in one run.

    python bench/run.py            # models 1M and 20M, factors 1, 2, 4, 8, 3 repetitions (about 35 min, 2 cores)
    python bench/run.py --quick    # 1M model only, shorter epochs (a few minutes)

Every variant (bench/variants.py) trains the same model, data and schedule; each launch is a fresh
`torchrun --standalone --nproc_per_node 2` of bench/worker.py, so time to first step and peak RSS include
everything a real run pays (imports, process group, framework set-up). Repetitions are interleaved (round i runs
every variant once, in a rotated order) and ratios are taken within a round, against the hand-written no_sync
loop; the tables show their median [min-max]. Rounds and bytes per optimizer step come from a DDP comm hook;
the agreement column is the largest parameter difference from a plain-torch large-batch reference computed here.
Not a test: nothing here asserts timings; the target lines at the end say MET or MISSED.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import report  # noqa: E402  (bench/ is not a package; these are its siblings)
import startup  # noqa: E402
from variants import BASELINE, FSDP_PAIRS, VARIANTS  # noqa: E402  (imports torch: only for the tensors it passes around)
from workload import Workload, param_count, reference  # noqa: E402

# Epoch lengths leave partial windows at factors 4 and 8 (62 = 8*7 + 6, 190 = 8*23 + 6, 30 = 8*3 + 6).
QUICK = [Workload(model="1M", batches=62, epochs_per_factor=2)]
SMOKE = [Workload(model="1M", batches=14, factors=(1, 4), epochs_per_factor=1)]
# --fsdp: the FSDP2 rows in a few minutes: throughput on 1M, memory on 20M (30 = 4*7 + 2: a partial window)
FSDP = [Workload(model="1M", batches=30, factors=(1, 4), epochs_per_factor=1),
        Workload(model="20M", batches=10, factors=(1, 4), epochs_per_factor=1)]
FULL = [Workload(model="1M", batches=190, epochs_per_factor=3), Workload(model="20M", batches=30, epochs_per_factor=2)]


def launch(name: str, workload: Workload, prefix: str, save_params: bool, timeout: float) -> list[dict]:
    """One fresh 2-rank torchrun of one variant; returns both ranks' records (raises with the log tail)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workload.world}",
           os.path.join(HERE, "worker.py"), name, json.dumps(workload.to_json()), prefix]
    if save_params:
        cmd.append("--save-params")
    paths = [f"{prefix}.rank{rank}.json" for rank in range(workload.world)]
    for path in paths + [prefix + ".params.pt"]:
        if os.path.exists(path):
            os.remove(path)  # a record left by an earlier run must not pass for this launch's
    with open(prefix + ".log", "w") as log:
        env["BENCH_LAUNCH_TIME"] = repr(time.time())
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # this launch's torchrun and its two workers, nothing else
            proc.wait()
            raise RuntimeError(f"no result after {timeout:.0f} s (log: {prefix}.log)") from None
    if proc.returncode != 0 and not all(os.path.exists(p) for p in paths):
        with open(prefix + ".log") as f:
            tail = [line.strip() for line in f if line.strip()][-3:]
        raise RuntimeError(f"exit {proc.returncode}: {' | '.join(tail)} (log: {prefix}.log)")
    # Every rank wrote its record, so the measurement is complete even if a rank then died: gloo's teardown
    # occasionally aborts a process here ("terminate called without an active exception", after
    # destroy_process_group) in any variant, the plain loops included.
    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    if proc.returncode != 0:
        print(f"    (exit {proc.returncode} after both records were written: kept; log: {prefix}.log)", flush=True)
    return records


def missing_requirements(names: list[str]) -> dict[str, str]:
    skipped = {}
    for name in names:
        for module in VARIANTS[name].requires:
            if importlib.util.find_spec(module) is None:
                skipped[name] = f"{module} is not installed (pip install -e '.[bench]')"
    return skipped


def versions() -> str:
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for module in ("lightning", "accelerate", "deepspeed"):
        if importlib.util.find_spec(module) is not None:
            from importlib.metadata import version

            parts.append(f"{module} {version(module)}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M model, shorter epochs: a few minutes")
    parser.add_argument("--fsdp", action="store_true", help="short FSDP2-sized workloads (1M and 20M, factors 1 and 4)")
    parser.add_argument("--smoke", action="store_true", help="a tiny end-to-end check of the pipeline (numbers "
                        "meaningless)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--models", default=None, help="comma-separated subset of 1M,20M")
    parser.add_argument("--out", default=None, help="directory for logs and results (default runs/bench-<time>)")
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up measurements")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed to one launch")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if BASELINE not in names:
        names.insert(0, BASELINE)  # every ratio is relative to it
    workloads = SMOKE if args.smoke else FSDP if args.fsdp else QUICK if args.quick else FULL
    if args.models:
        pool = workloads + FULL
        wanted = [m for m in dict.fromkeys(args.models.split(",")) if m]
        bad = [m for m in wanted if not any(w.model == m for w in pool)]
        if bad:
            parser.error(f"unknown model(s) {', '.join(bad)}; choose from 1M, 20M")
        workloads = [next(w for w in pool if w.model == m) for m in wanted]
    out_dir = args.out or os.path.join(ROOT, "runs", "bench-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    skipped = missing_requirements(names)
    runnable = [n for n in names if n not in skipped]
    started = time.time()
    header = (f"accum-sched benchmark, {datetime.date.today().isoformat()}, {platform.machine()} "
              f"{os.cpu_count()} CPU core(s), {versions()}")
    print(header, flush=True)

    texts, verdict_lines, results = [header], [], {}
    for w in workloads:
        records: dict[str, dict[int, list]] = {n: {} for n in runnable}  # variant -> repetition -> rank records
        errors: dict[str, str] = {}
        params_saved: set[str] = set()
        for rep in range(args.reps):
            order = runnable[rep % len(runnable):] + runnable[:rep % len(runnable)]  # rotate: no fixed position
            for name in order:
                for attempt in range(2):  # one retry: a launch on a busy machine can fail for reasons not its own
                    prefix = os.path.join(out_dir, f"{w.model}-{name}-rep{rep}" + ("-retry" if attempt else ""))
                    t0 = time.time()
                    try:
                        records[name][rep] = launch(name, w, prefix, save_params=name not in params_saved,
                                                    timeout=args.timeout)
                    except RuntimeError as exc:
                        errors[name] = f"launch failed: {exc}"
                        print(f"  {w.model} rep {rep + 1}/{args.reps} {name}: FAILED {exc}", flush=True)
                        continue
                    if name not in params_saved:
                        params_saved.add(name)
                        os.replace(prefix + ".params.pt", os.path.join(out_dir, f"{w.model}-{name}.params.pt"))
                    print(f"  {w.model} rep {rep + 1}/{args.reps} {name}: {time.time() - t0:.0f} s", flush=True)
                    break
        failed = dict(skipped)
        failed.update({n: errors[n] for n in runnable if not records[n]})
        records = {n: r for n, r in records.items() if r}
        if BASELINE in failed:
            texts.append(f"model {w.model}: the baseline failed ({failed[BASELINE]}); no ratios")
            continue
        agreement = _agreement(w, out_dir, list(records))
        summary = report.summarise(w, records, {n: VARIANTS[n] for n in records}, BASELINE, agreement,
                                   {n: failed[n] for n in names if n in failed})
        results[w.model] = {"workload": w.to_json(), "summary": summary}
        text = report.render(w, param_count(w.model), summary, VARIANTS, args.reps)
        texts.append(text)
        print("\n" + text, flush=True)
        verdict_lines += [f"[{w.model}] {line}" for line in report.verdicts(
            summary, "engine", BASELINE, ("lightning", "accelerate"))]
        pairs = report.summarise_pairs(w, records, FSDP_PAIRS)
        if pairs:
            results[w.model]["fsdp"] = pairs
            text = report.render_pairs(pairs, VARIANTS)
            texts.append(text)
            print("\n" + text, flush=True)
            verdict_lines += [f"[{w.model}] {line}" for line in report.pair_verdicts(pairs, FSDP_PAIRS[:2])]

    if not args.no_startup:
        print("\nstart-up (fresh interpreters, medians of 3):", flush=True)
        rows = startup.measure(runs=3)
        results["startup"] = rows
        texts.append("start-up (fresh interpreters, medians of 3)\n" + startup.render(rows))
        print(startup.render(rows), flush=True)
    texts.append("targets\n" + "\n".join(verdict_lines))
    print("\ntargets\n" + "\n".join(verdict_lines))
    footer = (f"command: python bench/run.py {' '.join(sys.argv[1:] if argv is None else argv)}; "
              f"took {(time.time() - started) / 60:.1f} min; logs and results.json in {os.path.relpath(out_dir, ROOT)}")
    texts.append(footer)
    print("\n" + footer)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write("\n\n".join(texts) + "\n")
    return 0


def _agreement(w: Workload, out_dir: str, names: list[str]) -> dict[str, float]:
    """max |param - reference| of each variant's first complete run (the reference runs here, after the launches)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    ref = reference(w)
    out = {}
    for name in names:
        path = os.path.join(out_dir, f"{w.model}-{name}.params.pt")
        if os.path.exists(path):
            got = torch.load(path)
            out[name] = max((a - b).abs().max().item() for a, b in zip(got, ref))
    return out


if __name__ == "__main__":
    sys.exit(main())
