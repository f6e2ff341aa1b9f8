"""Side by side, in one run: Lightning's GradientAccumulationScheduler, Lightning + accum_sched's integration, and
the plain-torch large-batch reference, on the same setup (2 gloo CPU ranks under Lightning's DDP, schedule
{6: 2, 11: 4}, 12 epochs of 7 micro-batches per rank; tests/lightning_tasks.py).

    python bench/lightning_scheduler.py

Columns: the largest |parameter - reference| over both ranks; optimizer steps taken vs the total the LR scheduler was
given (Lightning: ``estimated_stepping_batches``; the integration: ``accumulation_total_steps()``); gradient
all-reduces per optimizer step (counted by tests/counters.py's CollectiveCounter, not by the product); the
wall-clock seconds of ``trainer.fit`` on rank 0 (the reference: one process, no Trainer).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, TESTS)

import lightning_tasks as tasks  # noqa: E402  (tests/ on the path)


def launch(out_dir: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tasks.WORLD),
               os.path.join(TESTS, "lightning_tasks.py"), out_dir]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])


def rows(out_dir: str):
    tasks.reference(tasks.CASES[0])  # warm-up: the first call pays for torch's lazy initialisation
    for case in tasks.CASES:
        start = time.perf_counter()
        ref, ref_steps = tasks.reference(case)
        ref_seconds = time.perf_counter() - start
        for kind, label in (("lightning", "Lightning GradientAccumulationScheduler"),
                            ("accum", "Lightning + accum_sched.integrations.lightning")):
            runs = [torch.load(os.path.join(out_dir, f"{case}-{kind}-{rank}.pt")) for rank in range(tasks.WORLD)]
            gap = max((p - r).abs().max().item() for got in runs for p, r in zip(got["params"], ref, strict=True))
            first = runs[0]
            yield (case, label, f"{gap:.1e}", f"{first['steps']} / {first['total']}",
                   f"{first['allreduces'] / first['steps']:.2f}", f"{first['seconds']:.2f}")
        yield case, "plain-torch reference", "0", f"{ref_steps} / {ref_steps}", "-", f"{ref_seconds:.2f}"


def main() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        launch(out_dir)
        header = ("case", "run", "max abs(param - ref)", "steps / LR total", "all-reduces per step", "fit s")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows(out_dir):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
