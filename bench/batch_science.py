"""Experiment: does growing the batch replace LR decay? Six arms at equal samples, 3 seeds each (docs/batch-size.md).

    python bench/batch_science.py                          # 2 gloo ranks; about 15-25 minutes on 2 cores
    python bench/batch_science.py --seeds 0 --epochs 2     # a quick look

Task: builtin:charlm on a corpus made of this repository's own documentation (README.md and docs/*.md, one line of
at least 20 characters per sample), 10% of the lines held out for validation. The corpus the documented results
trained on is committed (bench/results/batch_science/corpus.txt, the default ``--corpus``), so a rerun reproduces
them; ``--corpus docs`` makes a new one from the docs as they are now (written to OUT/corpus.txt). Every arm
trains the same model (AdamW, lr 3e-3, weight decay 0.01, clipping 1.0) for the same ``--epochs`` over the same
training lines (micro-batch 4 per rank, 2 ranks), so every arm sees the same samples; only how they are grouped
into optimizer steps, and the LR, differ:

- ``small + step decay``: factor 1; the LR halves at 50% and 75% of the samples (MultiStepLR);
- ``large``: factor 4 throughout at lr x 2 (the sqrt rule for Adam), the same decays at the same sample points;
- ``smith``: ``schedule_from: {rule: smith, max_factor: 4}`` of the first arm: each halving becomes factor x 2;
- ``seesaw``: ``schedule_from: {rule: seesaw, max_factor: 4}``: each halving becomes factor x 2 and LR x 1/sqrt(2);
- ``cbs warm-up``: `accum-sched cbs` from the first arm's checkpoint after epoch 0 (factors 1, 2, 4 over a quarter
  of an epoch's samples, tolerance 1%), then factor 1 up to that step and the critical factor after it, with the
  decays at the same sample points;
- ``adaptive``: ``accumulation.adaptive: {min_factor: 1, max_factor: 4}``; its LR scheduler is planned over the
  factor-1 step count (the adaptive total is an upper bound), so its decays come later in samples, or not at all.

Reported per arm: final validation loss (mean +- std over seeds), optimizer steps, wall-clock seconds of the run
(summary.json's wall_seconds, this machine) and of its `accum-sched run` process (startup included); for the cbs
arm also the probe's seconds (its 3 branch processes) and the factor it picked. Writes OUT/results.json (the runs,
the table, and the corpus's line count and sha256) and OUT/batch_science.png. Asserts nothing.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

BASE = """\
run: {{output_dir: {out}, seed: {seed}, epochs: {epochs}}}
task: {{target: builtin:charlm, args: {{max_len: 64, d_model: 64, n_heads: 4, n_layers: 2, val_fraction: 0.1,
                                      corpus: {corpus}}}}}
data: {{micro_batch_size: 4, shuffle: true}}
accumulation: {accumulation}
optimizer: {{name: adamw, lr: {lr}, weight_decay: 0.01, max_grad_norm: 1.0}}
lr_scheduler: {{name: torch.optim.lr_scheduler.MultiStepLR, args: {{milestones: {milestones}, gamma: 0.5}}}}
eval: {{every_n_epochs: {epochs}}}
checkpoint: {{keep_last: 100}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: none, tensorboard: "off"}}
"""
ARMS = ("small + step decay", "large", "smith", "seesaw", "cbs warm-up", "adaptive")


def accum(*args) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"accum-sched {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return done.stdout


CORPUS = os.path.join(HERE, "results", "batch_science", "corpus.txt")  # the text the committed results trained on


def write_corpus(out: str) -> str:
    """A new corpus from the documentation as it is now (``--corpus docs``): the docs change, so its numbers differ
    from the committed results, which trained on CORPUS."""
    lines = []
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(path, encoding="utf-8") as f:
            lines += [line.strip() for line in f if len(line.strip()) >= 20 and not line.startswith("|")]
    path = os.path.join(out, "corpus.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def micro_batches_per_epoch(corpus: str) -> int:
    """Micro-batches per rank per epoch of the training split (2 ranks, micro-batch 4; DistributedSampler pads),
    from the task's own dataset (LineDataset cuts long lines into several samples)."""
    sys.path.insert(0, ROOT)
    from launcher.tasks import build

    train = build("builtin:charlm", {"max_len": 64, "d_model": 64, "n_heads": 4, "n_layers": 2, "val_fraction": 0.1,
                                     "corpus": corpus}).dataset
    return math.ceil(math.ceil(len(train) / 2) / 4)


def config(out_dir: str, name: str, seed: int, epochs: int, corpus: str, accumulation: str, milestones: list,
           lr: float = 0.003) -> str:
    path = os.path.join(out_dir, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(BASE.format(out=os.path.join(out_dir, name), seed=seed, epochs=epochs, corpus=corpus,
                            accumulation=accumulation, lr=lr, milestones=list(milestones)))
    return path


def run_arm(arm: str, seed: int, epochs: int, corpus: str, batches: int, out: str) -> dict:
    d = os.path.join(out, f"seed{seed}")
    os.makedirs(d, exist_ok=True)
    total = epochs * batches  # factor-1 steps = micro-batches per rank over the run
    half, three = total // 2, (3 * total) // 4
    extra = {}
    slug = arm.split()[0]
    if arm == "small + step decay":
        path = config(d, slug, seed, epochs, corpus, "{schedule: {0: 1}}", [half, three])
    elif arm == "large":
        per_epoch = math.ceil(batches / 4)
        path = config(d, slug, seed, epochs, corpus, "{schedule: {0: 4}}",
                      [per_epoch * epochs // 2, per_epoch * epochs * 3 // 4], lr=0.006)
    elif arm in ("smith", "seesaw"):
        path = config(d, slug, seed, epochs, corpus, f"{{schedule_from: {{rule: {arm}, max_factor: 4}}}}",
                      [half, three])
    elif arm == "cbs warm-up":
        base = os.path.join(d, "small")
        began = time.monotonic()
        probe = accum("cbs", os.path.join(d, "small.yaml"), "--from", os.path.join(base, "checkpoints",
                                                                                   f"step-{batches:08d}"),
                      "--factors", "1,2,4", "--samples", str(batches * 2), "--tolerance", "0.01", "--apply")
        extra["probe_seconds"] = round(time.monotonic() - began, 3)  # the 3 branches, processes included
        with open(os.path.join(base, "cbs", "cbs.json"), encoding="utf-8") as f:
            pick = json.load(f)["critical_factor"]
        extra["critical_factor"] = pick
        per_epoch = math.ceil(batches / pick)  # steps per epoch after the first (its last window may be partial)

        def steps_at(micro: int) -> int:  # optimizer steps taken when ``micro`` micro-batches have been read
            if micro <= batches:
                return micro
            epochs_done, rest = divmod(micro - batches, batches)
            return batches + epochs_done * per_epoch + math.ceil(rest / pick)

        path = config(d, "cbs", seed, epochs, corpus, f"{{unit: step, schedule: {{0: 1, {batches}: {pick}}}}}",
                      [steps_at(half), steps_at(three)])
        del probe
    else:
        path = config(d, slug, seed, epochs, corpus, "{adaptive: {min_factor: 1, max_factor: 4}}", [half, three])
    began = time.monotonic()
    accum("run", path)
    process_seconds = round(time.monotonic() - began, 3)
    run_dir = path[:-5]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        factors = sorted({json.loads(line)["factor"] for line in f})
    return {"arm": arm, "seed": seed, "val_loss": summary["last_eval"]["val_loss"],
            "steps": summary["optimizer_steps"], "samples": summary["samples"],
            "seconds": summary["wall_seconds"], "process_seconds": process_seconds, "factors": factors, **extra}


def table(results: list[dict]) -> list[str]:
    lines = ["| arm | final val loss (mean ± std) | optimizer steps | samples | run s | process s | factors |",
             "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        rows = [r for r in results if r["arm"] == arm]
        if not rows:
            continue
        losses = [r["val_loss"] for r in rows]
        std = statistics.stdev(losses) if len(losses) > 1 else 0.0
        steps = sorted({r["steps"] for r in rows})
        seconds = statistics.mean(r["seconds"] for r in rows)
        process = statistics.mean(r["process_seconds"] for r in rows)
        factors = sorted({f for r in rows for f in r["factors"]})
        lines.append(f"| {arm} | {statistics.mean(losses):.4f} ± {std:.4f} | {'/'.join(map(str, steps))} | "
                     f"{rows[0]['samples']} | {seconds:.1f} | {process:.1f} | {factors} |")
    return lines


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for arm in ARMS:
        rows = [r for r in results if r["arm"] == arm]
        if rows:
            losses = [r["val_loss"] for r in rows]
            ax.errorbar(statistics.mean(r["steps"] for r in rows), statistics.mean(losses),
                        yerr=statistics.stdev(losses) if len(losses) > 1 else 0, fmt="o", capsize=3, label=arm)
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("final validation loss")
    ax.set_title("equal samples; mean ± std over seeds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-batch-science"))
    parser.add_argument("--corpus", default=CORPUS,
                        help="a text file, one sample a line (default: the committed corpus the documented results "
                             "used), or 'docs' for a new one made of README.md and docs/*.md as they are now")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    corpus = write_corpus(args.out) if args.corpus == "docs" else os.path.abspath(args.corpus)
    batches = micro_batches_per_epoch(corpus)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in ARMS:
            results.append(run_arm(arm, seed, args.epochs, corpus, batches, args.out))
            print(json.dumps(results[-1]), flush=True)
    with open(corpus, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(corpus, encoding="utf-8") as f:
        n_lines = sum(1 for _ in f)
    meta = {"command": " ".join(["python", "bench/batch_science.py", *sys.argv[1:]]), "epochs": args.epochs,
            "seeds": [int(s) for s in args.seeds.split(",")],
            "corpus": {"lines": n_lines, "sha256": digest, "micro_batches_per_rank_per_epoch": batches},
            "table": table(results), "runs": results}
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    plot(results, os.path.join(args.out, "batch_science.png"))
    print(f"corpus: {corpus} ({batches} micro-batches per rank per epoch), {args.epochs} epochs")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
