"""What a checkpoint takes out of training: the same training run with no step checkpoints, synchronous ones and
background ones (checkpoint.async), saving every step and every 10 steps, at 1M and 20M parameters.

    python bench/checkpoint_cost.py                 # 1M and 20M, 3 rounds
    python bench/checkpoint_cost.py --models 1M --rounds 1 --steps 11

Each variant is the workers' own Trainer (launcher/train/trainer.py, what `accum-sched run` runs in each worker)
built afresh from its config and fitted, in this one process (one worker: no launch, no start-up in the numbers,
and every variant under the same load within a round), on bench/checkpoint_task.py's MLP (bench/workload.py: the
model the other benchmarks time), one epoch of ``--steps`` optimizer steps at factor 1, AdamW (so a checkpoint
holds the weights and two moments), one intra-op thread (``--threads``: on a shared machine more threads than
free cores made a 1M step 7x slower here). Timed: metrics.jsonl's elapsed_s from step 1 to the last step, so
start-up, the first step and the epoch-end checkpoint every variant takes after the last step are left out; a
checkpoint at step k is inside that span for k < steps. ``none2`` is ``none`` again: the A/A row, the instrument's
own noise. Variants run in an order shuffled per round; printed per model: the ratio none / variant (1.0: the
checkpoints cost nothing), median [min-max] over rounds, the milliseconds each checkpoint took out of training,
(variant - none) / checkpoints in the span, and how long the Checkpointer's save call held the training thread
per checkpoint in the span (a background save: the host copy and the wait for the save before it). `uptime` is
printed before and after. Not a test: nothing here asserts.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]  # the project, and checkpoint_task beside this file

import torch  # noqa: E402

CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 1}}
task: {{target: "checkpoint_task:mlp", args: {{size: {model}, samples: {samples}}}}}
data: {{micro_batch_size: 32, shuffle: false}}
optimizer: {{name: adamw, lr: 0.0001}}
distributed: {{backend: ddp, nproc_per_node: 1}}
checkpoint: {{every_n_steps: {every}, keep_last: 2, async: {background}}}
logging: {{progress: none, tensorboard: "off"}}
"""
# name: (every_n_steps, async); none saves only at the epoch end, after the timed span
VARIANTS = {"none": ("null", False), "none2": ("null", False), "sync@1": (1, False), "async@1": (1, True),
            "sync@10": (10, False), "async@10": (10, True)}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


HELD: list[float] = []  # seconds each save call in the timed span held the training thread


def held_saves(steps: int) -> None:
    """Time the Checkpointer's save calls of the steps inside the span (a checkpoint at step k < steps)."""
    from launcher.checkpoint.checkpointer import Checkpointer

    save = Checkpointer.save

    def timed_save(self, reason):
        began = time.perf_counter()
        path = save(self, reason)
        if reason == "step" and self.engine.optimizer_steps < steps:
            HELD.append(time.perf_counter() - began)
        return path

    Checkpointer.save = timed_save


def timed(tmp: str, name: str, model: str, steps: int, run: int) -> tuple[float, list[float]]:
    """Seconds from step 1's metrics line to the last step's, in a fresh Trainer of variant ``name``, and the
    seconds its save calls in that span held the training thread."""
    from launcher.config.schema import load_config  # after sys.path has the project
    from launcher.train.trainer import Trainer

    every, background = VARIANTS[name]
    out = os.path.join(tmp, f"{model}-{name}-{run}")
    path = out + ".yaml"
    with open(path, "w") as f:
        f.write(CONFIG.format(out=out, model=model, samples=steps * 32, every=every,
                              background=str(background).lower()))
    HELD.clear()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer = Trainer(load_config(path), torch.device("cpu"))
        trainer.fit()
        del trainer
        gc.collect()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [m["step"] for m in lines] == list(range(1, steps + 1)), "one line per step"
    shutil.rmtree(out)
    return lines[-1]["elapsed_s"] - lines[0]["elapsed_s"], list(HELD)


def saves_in_span(name: str, steps: int) -> int:
    every = VARIANTS[name][0]
    return 0 if every == "null" else (steps - 1) // every  # checkpoints at steps k < steps, k a multiple of every


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="1M,20M")
    parser.add_argument("--steps", type=int, default=21, help="optimizer steps (one epoch at factor 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    held_saves(args.steps)
    print(f"before: {uptime()}", flush=True)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as tmp:
        for model in args.models.split(","):
            seconds, held = {name: [] for name in VARIANTS}, {name: [] for name in VARIANTS}
            timed(tmp, "none", model, args.steps, -1)  # warm-up: first imports and allocations, not timed
            for run in range(args.rounds):
                order = list(VARIANTS)
                rng.shuffle(order)
                for name in order:
                    span, calls = timed(tmp, name, model, args.steps, run)
                    seconds[name].append(span)
                    held[name] += calls
                    print(f"  {model} {name}: {seconds[name][-1]:.3f} s", flush=True)
            for name in VARIANTS:
                if name == "none":
                    continue
                ratios = [n / v for n, v in zip(seconds["none"], seconds[name])]
                saves = saves_in_span(name, args.steps)
                cost = [1000 * (v - n) / saves for n, v in zip(seconds["none"], seconds[name])] if saves else None
                assert len(held[name]) == saves * args.rounds, (name, len(held[name]))
                hold = statistics.median(held[name]) * 1000 if saves else None
                rows.append((model, name, saves, ratios, cost, hold, statistics.median(seconds[name])))
    print(f"after: {uptime()}", flush=True)
    print(f"\n{args.steps} steps, one worker, {args.threads} thread(s), {args.rounds} round(s); span: step 1 to step "
          f"{args.steps}\n")
    print("| model | variant | checkpoints in span | none / variant | ms out of training per checkpoint | "
          "ms the save call held training (median) | span s (median) |")
    print("|---|---|---|---|---|---|---|")
    for model, name, saves, ratios, cost, hold, span in rows:
        ratio = f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
        ms = "-" if cost is None else f"{statistics.median(cost):.0f} [{min(cost):.0f}-{max(cost):.0f}]"
        hold = "-" if hold is None else f"{hold:.0f}"
        print(f"| {model} | {name} | {saves} | {ratio} | {ms} | {hold} | {span:.2f} |")


if __name__ == "__main__":
    main()
