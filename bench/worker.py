"""One rank of one benchmark launch (started by torchrun from bench/run.py): train one variant, write its record.

    torchrun --standalone --nproc_per_node 2 bench/worker.py VARIANT WORKLOAD_JSON OUT_PREFIX [--save-params]

Writes OUT_PREFIX.rank<r>.json (per-epoch seconds, steps, all-reduce rounds and bytes; time from launch to the first
optimizer step; peak RSS) and, with --save-params, OUT_PREFIX.params.pt from rank 0.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

LAUNCHED_AT = float(os.environ.get("BENCH_LAUNCH_TIME", time.time()))  # set by run.py just before starting torchrun


class Recorder:
    """What a variant reports while it trains; rank-local, serialised at the end."""

    def __init__(self):
        self.steps = 0
        self.first_step_s: float | None = None
        self.epochs: dict[int, dict] = {}
        self.counts = lambda: (None, None)  # (all-reduce rounds, bytes) so far; set by the variant
        self.collectives = lambda: None  # {kind: calls, "bytes": ...} so far, where a variant counts them (FSDP2)
        self._open = None

    def step(self) -> None:
        self.steps += 1
        if self.first_step_s is None:
            self.first_step_s = time.time() - LAUNCHED_AT

    def epoch_start(self, epoch: int) -> None:
        self._open = (time.perf_counter(), time.process_time(), self.steps, self.counts(), self.collectives())

    def epoch_end(self, epoch: int) -> None:
        start, cpu_start, steps, (rounds, nbytes), before = self._open
        after = self.collectives()
        seconds = time.perf_counter() - start
        now_rounds, now_bytes = self.counts()
        self.epochs[epoch] = {
            # CPU seconds of this process (all threads): the work done, whatever else keeps the cores busy
            "seconds": seconds, "cpu_seconds": time.process_time() - cpu_start, "steps": self.steps - steps,
            "rounds": None if rounds is None or now_rounds is None else now_rounds - rounds,
            "bytes": None if nbytes is None or now_bytes is None else now_bytes - nbytes,
            "collectives": None if after is None else {k: after[k] - before[k] for k in after},
        }


def main(argv: list[str]) -> int:
    name, workload_json, out_prefix = argv[:3]
    save_params = "--save-params" in argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from variants import VARIANTS
    from workload import Workload

    workload = Workload.from_json(json.loads(workload_json))
    rank = int(os.environ["RANK"])
    rec = Recorder()
    model = VARIANTS[name].run(workload, rec)
    record = {
        "variant": name, "rank": rank, "steps": rec.steps, "first_step_s": rec.first_step_s,
        "epochs": {str(k): v for k, v in rec.epochs.items()},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        "imported_deepspeed": "deepspeed" in sys.modules,
    }
    if rank == 0 and save_params:
        torch.save([p.detach().clone() for p in model.parameters()], f"{out_prefix}.params.pt")
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(record, f)
    # Leave without tearing the process group down: gloo's teardown occasionally aborts a process here
    # ("terminate called without an active exception") after the record is written. The barrier keeps a rank
    # from leaving while its peer still talks to it.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
