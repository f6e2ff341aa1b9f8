"""Count the host syncs of the engine's per-step path on a GPU: none per micro-batch, at most one per optimizer step.

    python bench/gpu_sync_check.py          # exits 0 saying so when there is no CUDA device

torch.cuda.set_sync_debug_mode("warn") makes every synchronising CUDA call (``.item()``, ``.tolist()``, a blocking
copy to the host, a pageable copy to the device, ...) issue a warning at the Python line that made it. The script
trains a small MLP with the engine on one GPU, first in one process, then wrapped in DDP over NCCL in a process
group of one (so the comm hook that carries the window's numbers inside a gradient bucket runs), records the
warnings, and counts those raised from accum_sched's files. Exit status 1 if a micro-batch syncs or a step syncs
more than once. The CPU twin of this check runs in CI: tests/accum_sched/test_perf_counts.py.
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS_FACTOR = {0: 1, 1: 4}  # epoch 0 at factor 1, epoch 1 at factor 4 with a partial last window
BATCHES, MICRO = 10, 32


def _train(model, optimizer, **engine_kwargs) -> tuple[int, int, list[str]]:
    """(optimizer steps, micro-batches, the accum_sched locations that synchronised) over two epochs."""
    from accum_sched import AccumulationEngine

    engine = AccumulationEngine(model, optimizer, STEPS_FACTOR, **engine_kwargs)
    g = torch.Generator(device="cuda").manual_seed(0)
    data = [(torch.randn(MICRO, 64, device="cuda", generator=g), torch.randn(MICRO, 8, device="cuda", generator=g))
            for _ in range(BATCHES)]
    for epoch in range(2):  # warm-up epoch outside the count: allocator, cuBLAS handles, DDP's bucket rebuild
        if epoch == 1:
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps_before, micro_before = engine.optimizer_steps, engine.micro_steps
            for x, y in engine.micro_batches(data, epoch):
                loss = ((engine.model(x) - y) ** 2).sum(-1)
                engine.backward(loss.sum(), x.shape[0])
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("default")
    ours = [f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in caught
            if "synchroniz" in str(w.message).lower() and os.sep + "accum_sched" + os.sep in w.filename]
    return engine.optimizer_steps - steps_before, engine.micro_steps - micro_before, ours


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_sync_check: no CUDA device here; nothing checked (the CPU count is "
              "tests/accum_sched/test_perf_counts.py)")
        return 0
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(0)
    failures = 0
    runs = {}
    model = _model()
    runs["one process, clip 1.0"] = _train(model, torch.optim.SGD(model.parameters(), lr=1e-3), max_grad_norm=1.0)
    model = _model()
    runs["one process, norm_every=None"] = _train(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                                  norm_every=None, micro_batch_size=MICRO)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        model = _model()
        runs["DDP over NCCL, clip 1.0"] = _train(DDP(model, device_ids=[0], bucket_cap_mb=0.1),
                                                 torch.optim.SGD(model.parameters(), lr=1e-3), max_grad_norm=1.0)
        dist.destroy_process_group()
    for name, (steps, micro, syncs) in runs.items():
        # + 1: the epoch start's agreement reads its result once (under a process group)
        ok = len(syncs) <= steps + 1
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {micro} micro-batches, {steps} optimizer steps, "
              f"{len(syncs)} host syncs from accum_sched" + (f": {sorted(set(syncs))}" if syncs else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
