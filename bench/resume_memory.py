"""Host memory of one rank loading trainer.pt at resume: torch.load into private memory vs. mmap=True.

    python bench/resume_memory.py [--mb 400]

Writes a trainer.pt like launcher/checkpoint/checkpointer.py does (model + AdamW state, about 3x the model), then
loads it in a fresh process each way and restores model and optimizer from it. Reported, at the moment both the
loaded dict and the restored model are alive (the peak): RssAnon (private: every rank of a node pays it), RssFile
(file pages: one page-cache copy per node, shared by its ranks and reclaimable).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) // 1024  # MiB
    return out


def build(mb: int):
    import torch

    width = 1024
    rows = max(1, mb * 2**20 // (4 * width))
    model = torch.nn.Linear(width, rows, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def load(path: str, mmap: bool, mb: int) -> dict:
    import torch

    model, optimizer = build(mb)
    base = status()
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if mmap:
        from launcher.checkpoint.checkpointer import own_optimizer_state

        own_optimizer_state(optimizer)  # what launcher/checkpoint/checkpointer.py does after an mmap load
    peak = status()
    return {"mmap": mmap, "before": base, "after_load": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=400, help="model size in MiB (the file is about 3x)")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "MMAP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(load(args.child[0], args.child[1] == "1", args.mb)))
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trainer.pt")
        model, optimizer = build(args.mb)
        model.weight.grad = torch.zeros_like(model.weight)
        optimizer.step()  # creates exp_avg / exp_avg_sq
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        size = os.path.getsize(path) // 2**20
        del model, optimizer
        for mmap in (False, True):
            env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
            out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--child", path, str(int(mmap))],
                                 capture_output=True, text=True, check=True, env=env).stdout
            r = json.loads(out)
            b, a = r["before"], r["after_load"]
            print(f"trainer.pt {size} MiB, mmap={mmap}: private (RssAnon) {b['RssAnon']} -> {a['RssAnon']} MiB "
                  f"(+{a['RssAnon'] - b['RssAnon']}), file pages (RssFile) +{a['RssFile'] - b['RssFile']} MiB")


if __name__ == "__main__":
    main()
