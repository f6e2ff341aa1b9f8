"""Side by side, in one run on the same data: the Hugging Face Trainer with a fixed factor, the Trainer with its
factor changed per epoch by a callback, AccumulationTrainer; Accelerate's accumulate() with a mutated factor and
make_engine. Two torchrun launches of 2 gloo CPU ranks (tests/transformers_tasks.py, tests/accelerate_tasks.py) on
tests/hf_reference.py's tiny GPT-2 and padded sequences, schedule {1: 2, 2: 4} over 3 epochs of 7 micro-batches per
rank.

    python bench/hf_compare.py

Columns: the largest |parameter - reference| over both ranks, against the plain-torch large-batch reference of the
run's own schedule (the fixed factor's: factor 2 throughout); optimizer steps taken; the LR scheduler's total (what
it was told) and the times it was stepped; gradient all-reduces per optimizer step (tests/counters.py, never the
product's counter); the wall-clock seconds of training on rank 0 (one sample on a shared machine, not a speed
benchmark).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, TESTS)

import hf_reference as ref  # noqa: E402  (tests/ on the path)
import transformers_tasks  # noqa: E402

TRAINER = (("fixed", f"Trainer, gradient_accumulation_steps={transformers_tasks.FIXED}"),
           ("callback", "Trainer, factor set per epoch by a callback"),
           ("accum", "AccumulationTrainer"))
ACCELERATE = (("mutated", "Accelerate accumulate(), factor mutated per epoch"),
              ("ddp", "Accelerate + make_engine"))


def launch(module: str, out_dir: str, variants) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ref.WORLD),
               os.path.join(TESTS, module), out_dir, *variants]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        launch("transformers_tasks.py", out, [v for v, _ in TRAINER])
        launch("accelerate_tasks.py", out, [v for v, _ in ACCELERATE])
        results = {v: [torch.load(os.path.join(out, f"{v}-{r}.pt")) for r in range(ref.WORLD)]
                   for v, _ in TRAINER + ACCELERATE}
    scheduled, steps = ref.reference()
    fixed, fixed_steps = ref.reference(schedule={0: transformers_tasks.FIXED})
    print("| run | max abs(param - ref) | steps | LR total / times stepped | all-reduces per step | s |")
    print("|---|---|---|---|---|---|")
    for variant, label in TRAINER + ACCELERATE:
        runs = results[variant]
        target = fixed if variant == "fixed" else scheduled
        gap = max(ref.gap(run["params"], target) for run in runs)
        run = runs[0]
        if "total" in run:  # the Trainer steps its scheduler once per optimizer step
            lr = f"{run['total']} / {run['steps']}"
        else:  # the Accelerate loops gave their scheduler the exact total
            lr = f"{ref.total_steps()} / {run['lr_steps']}"
        print(f"| {label} | {gap:.1e} | {run['steps']} | {lr} | {run['allreduces'] / run['steps']:.2f} | "
              f"{run['seconds']:.2f} |")
    print(f"| plain-torch reference (scheduled / fixed factor) | 0 | {steps} / {fixed_steps} | - | - | - |")


if __name__ == "__main__":
    main()
