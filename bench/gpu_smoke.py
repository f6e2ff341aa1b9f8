"""GPU smoke test: one command, one short run, on a machine with CUDA GPUs (docs/gpu.md).

    python bench/gpu_smoke.py [--out DIR] [--only NAME[,NAME]] [--cpu]

Checks, each reported PASS / FAIL / SKIP with its numbers (exit status 1 if any FAILs):
  devices    `accum-sched run` starts one process per visible GPU and each rank trains on cuda:LOCAL_RANK
  exact      fp32 DDP + engine on NCCL equals a single-process large-batch reference (partial windows, TF32 off)
  bf16/fp16  the same under autocast; fp16: an injected overflow is a skipped step and the loss scale backs off
  syncs      torch.cuda.set_sync_debug_mode("warn"): host syncs counted per optimizer step
  resume     a worker killed mid-run, resumed on the same GPUs and on one fewer, ends where the uninterrupted run ends
  deepspeed  ZeRO 0-3 bf16 under torchrun (and srun, one task per GPU, inside a SLURM allocation) vs DDP bf16
  timeout    a 10 s process-group timeout while rank 0 takes 20 s over a checkpoint: the run still finishes

Without CUDA it says so and exits 0 having checked nothing (it is not part of CI's pass count). ``--cpu`` runs what
it can on 2 CPU processes over gloo, to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


# -- a task that reports where it runs (and can die on request) ---------------------------------------------------
def probe_task(**args):
    """builtin:regression, whose loss_fn writes this rank's devices to $SMOKE_PROBE_DIR once and SIGKILLs itself at
    micro-batch $SMOKE_KILL_AT of rank 0 while $SMOKE_KILL_MARKER does not exist yet."""
    import signal

    import torch

    from launcher.tasks.builtin import regression

    task = regression(**args)
    inner, calls = task["loss_fn"], [0]

    def loss_fn(model, batch):
        calls[0] += 1
        rank = os.environ.get("RANK", "0")
        probe = os.environ.get("SMOKE_PROBE_DIR")
        if probe and calls[0] == 1:
            cuda = torch.cuda.is_available()
            with open(os.path.join(probe, f"rank{rank}.json"), "w") as f:
                json.dump({"rank": int(rank), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                           "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "current": torch.cuda.current_device() if cuda else None,
                           "param": str(next(model.parameters()).device), "input": str(batch[0].device),
                           "host": os.uname().nodename}, f)
        marker = os.environ.get("SMOKE_KILL_MARKER")
        if marker and rank == "0" and calls[0] == int(os.environ["SMOKE_KILL_AT"]) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(model, batch)

    task["loss_fn"] = loss_fn
    return task


def slow_save_worker(argv) -> int:
    """launcher.worker.main with rank 0 taking 20 s over its first checkpoint commit (hash + fsync stand-in)."""
    from launcher import worker
    from launcher.checkpoint import store as checkpoint_store

    commit, slept = checkpoint_store.commit, []

    def slow_commit(*args, **kwargs):
        if not slept:  # the first checkpoint: the other ranks then wait 20 s, twice the group's timeout
            slept.append(time.sleep(20))
        return commit(*args, **kwargs)

    checkpoint_store.commit = slow_commit
    return worker.main(argv)


# -- helpers ------------------------------------------------------------------------------------------------------
class Smoke:
    def __init__(self, out: str, world: int, cpu: bool):
        self.out, self.world, self.cpu = out, world, cpu
        self.results: list[tuple[str, str, str]] = []

    def record(self, name: str, ok, detail: str) -> None:
        status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        self.results.append((name, status, detail))
        print(f"[{status}] {name}: {detail}", flush=True)

    def config(self, name: str, **sections) -> str:
        import yaml

        cfg = {"run": {"output_dir": os.path.join(self.out, name), "seed": 0, "epochs": 4},
               "task": {"target": "bench.gpu_smoke:probe_task", "args": {"samples": 1000}},
               "data": {"micro_batch_size": 16, "shuffle": True},
               "accumulation": {"schedule": {0: 1, 1: 2, 2: 3}},
               "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "lr_scheduler": None,
               "distributed": {"nproc_per_node": self.world, "process_group": "gloo" if self.cpu else "auto"},
               "logging": {"progress": "plain"}}
        for section, values in sections.items():
            cfg[section] = {**(cfg.get(section) or {}), **values}
        path = os.path.join(self.out, f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    def env(self, **extra) -> dict:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}
        if self.cpu:
            env["DS_ACCELERATOR"] = "cpu"
        return env

    def accum(self, *args, timeout=600, **env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=self.env(**env))

    def model(self, name: str) -> dict:
        import torch

        return torch.load(os.path.join(self.out, name, "model.pt"), map_location="cpu", weights_only=True)


def max_gap(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def tail(proc) -> str:
    return (proc.stderr or proc.stdout or "").strip().splitlines()[-1:][0] if (proc.stderr or proc.stdout) else ""


# -- checks -------------------------------------------------------------------------------------------------------
def check_devices(s: Smoke) -> None:
    probe = os.path.join(s.out, "probe")
    os.makedirs(probe, exist_ok=True)
    proc = s.accum("run", s.config("devices", run={"epochs": 1}), SMOKE_PROBE_DIR=probe)
    if proc.returncode:
        return s.record("devices", False, f"run failed ({proc.returncode}): {tail(proc)}")
    seen = [json.load(open(os.path.join(probe, f))) for f in sorted(os.listdir(probe))]
    ranks = sorted(r["rank"] for r in seen)
    bad = [r for r in seen if not s.cpu and not (r["current"] == r["local_rank"]
                                                 and r["param"] == r["input"] == f"cuda:{r['local_rank']}")]
    devices = {r["param"] for r in seen}
    ok = ranks == list(range(s.world)) and not bad and (s.cpu or len(devices) == s.world)
    s.record("devices", ok, f"{len(seen)} ranks for {s.world} GPUs; devices {sorted(devices)}"
                            + (f"; wrong: {bad}" if bad else ""))


def _engine_runs(rank: int, world: int, out: str, cpu: bool) -> None:
    """On every rank (NCCL on GPUs): fp32 / bf16 / fp16 runs of one case, and host syncs per step."""
    import warnings

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cases
    from accum_sched import AccumulationEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    case = cases.CASES[0]  # sgd, factors 1..5, short last micro-batches
    loss_fn = cases.loss_fn_for(case.kind)

    def train(precision="fp32", overflow_at=None, sync_debug=False):
        model = cases.make_model(case).to(device)
        ddp = DDP(model, device_ids=None if cpu else [rank])
        engine = AccumulationEngine(ddp, cases.make_optimizer(case, model), case.schedule, precision=precision,
                                    micro_batch_size=case.micro)
        scaler = getattr(engine.backend, "scaler", None)
        scale0 = scaler.get_scale() if scaler is not None else None
        calls, syncs = [0], []

        def fn(m, batch):
            calls[0] += 1
            loss, n = loss_fn(m, tuple(t.to(device) for t in batch))
            return (loss * 1e8 if calls[0] == overflow_at else loss), n

        steps_before = 0
        for epoch in range(case.epochs):
            batches = cases.rank_batches(case, rank, epoch)
            if sync_debug and epoch == case.epochs - 1:
                torch.cuda.synchronize()
                steps_before = engine.optimizer_steps
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    engine.train_epoch(batches, fn, epoch)
                torch.cuda.set_sync_debug_mode(0)
                syncs = [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)]
            else:
                engine.train_epoch(batches, fn, epoch)
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        return {"state": state, "skipped": engine.skipped_steps, "steps": engine.optimizer_steps,
                "scale": (scale0, scaler.get_scale()) if scaler is not None else None,
                "syncs": len(syncs), "sync_steps": engine.optimizer_steps - steps_before, "sync_kinds": syncs[:3]}

    runs = {"fp32": train(), "bf16": train("bf16")}
    if not cpu:
        runs["fp16"] = train("fp16")
        runs["fp16-overflow"] = train("fp16", overflow_at=3)
        runs["syncs"] = train(sync_debug=True)
    if rank == 0:
        torch.save(runs, os.path.join(out, "engine_runs.pt"))


def check_engine(s: Smoke) -> None:
    import torch

    import cases
    from distributed import spawn

    if s.cpu:
        spawn(_engine_runs, s.world, s.out, True, deadline_s=600)
    else:
        _spawn_nccl(_engine_runs, s.world, s.out)
    runs = torch.load(os.path.join(s.out, "engine_runs.pt"), weights_only=False)
    ref = cases.reference(cases.CASES[0], s.world).state_dict()
    gap = max_gap(runs["fp32"]["state"], ref)
    s.record("exact", gap < 1e-5, f"fp32 on {s.world} ranks vs one-process large batch: max |diff| {gap:.2e} "
                                  f"(pass < 1e-5)")
    gap = max_gap(runs["bf16"]["state"], ref)
    s.record("bf16", gap < 5e-2, f"max |diff| vs fp32 reference {gap:.2e} (pass < 5e-2)")
    if "fp16" not in runs:
        s.record("fp16", None, "needs CUDA (torch GradScaler)")
        s.record("syncs", None, "needs CUDA")
        return
    f, o = runs["fp16"], runs["fp16-overflow"]
    gap = max_gap(f["state"], ref)
    finite = all(torch.isfinite(v).all() for v in o["state"].values())
    ok = gap < 5e-2 and o["skipped"] > f["skipped"] and o["scale"][1] < o["scale"][0] and finite
    s.record("fp16", ok, f"max |diff| {gap:.2e}; skipped {f['skipped']}/{f['steps']} (scale {f['scale'][0]:g} -> "
                         f"{f['scale'][1]:g}); injected overflow: skipped {o['skipped']}/{o['steps']}, scale "
                         f"{o['scale'][0]:g} -> {o['scale'][1]:g}")
    r = runs["syncs"]
    per_step = r["syncs"] / max(r["sync_steps"], 1)
    s.record("syncs", per_step <= 2, f"{r['syncs']} host syncs over {r['sync_steps']} optimizer steps "
                                     f"({per_step:.1f}/step, pass <= 2); first: {r['sync_kinds']}")


def _nccl_entry(rank: int, world: int, port: int, fn, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    fn(rank, world, out, False)
    dist.barrier()
    dist.destroy_process_group()


def _spawn_nccl(fn, world: int, out: str) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_nccl_entry, args=(world, port, fn, out), nprocs=world, start_method="spawn")


def check_resume(s: Smoke) -> None:
    every = {"every_n_steps": 2}
    # factors that stay whole when one rank fewer keeps the global batch (x world / (world - 1))
    unit = max(1, s.world - 1)
    schedule = {"accumulation": {"schedule": {0: unit, 2: 2 * unit}}}
    shard = -(-1000 // s.world)  # samples per rank (ceiling division)
    per_rank = -(-shard // 16)  # micro-batches per rank per epoch (1000 samples, micro 16)
    kill_at = str(per_rank * 4 // 2 + 1)  # rank 0 dies half-way through the 4 epochs, mid-window when factor > 1
    ref = s.accum("run", s.config("resume-ref", checkpoint=every, **schedule))
    if ref.returncode:
        return s.record("resume", False, f"uninterrupted run failed: {tail(ref)}")
    want = s.model("resume-ref")
    gaps = []
    for name, world in (("same", s.world), ("fewer", s.world - 1)):
        if world < 1 or (name == "fewer" and s.world < 2):
            gaps.append(f"{name}: skipped (one GPU)")
            continue
        marker = os.path.join(s.out, f"killed-{name}")
        cfg = s.config(f"resume-{name}", checkpoint={**every, "on_world_change": "keep_global_batch"}, **schedule)
        first = s.accum("run", cfg, SMOKE_KILL_MARKER=marker, SMOKE_KILL_AT=kill_at)
        if first.returncode == 0 or not os.path.exists(marker):
            return s.record("resume", False, f"{name}: the kill did not happen ({first.returncode})")
        again = s.accum("run", cfg, "--resume", "auto", "--nproc-per-node", str(world))
        if again.returncode:
            return s.record("resume", False, f"{name}: resume on {world} failed: {tail(again)}")
        gap = max_gap(s.model(f"resume-{name}"), want)
        # same world: the same arithmetic (bitwise on CPU); fewer: the same windows summed in another order
        if gap > (1e-6 if name == "same" else 1e-4):
            return s.record("resume", False, f"{name} ({world} ranks): max |diff| {gap:.2e} vs uninterrupted")
        gaps.append(f"{name} ({world} ranks): max |diff| {gap:.2e}")
    s.record("resume", True, "; ".join(gaps))


def check_deepspeed(s: Smoke) -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return s.record("deepspeed", None, "deepspeed is not installed")
    precision = {"run": {"precision": "bf16"}}
    base = s.accum("run", s.config("ds-ddp-bf16", **precision))
    if base.returncode:
        return s.record("deepspeed", False, f"DDP bf16 run failed: {tail(base)}")
    want = s.model("ds-ddp-bf16")
    notes = []
    stages = (2,) if s.cpu else (0, 1, 2, 3)
    for stage in stages:
        ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
        if stage in (1, 3):
            ds["data_types"] = {"grad_accum_dtype": "fp32"}
        name = f"ds-z{stage}"
        proc = s.accum("run", s.config(name, distributed={"backend": "deepspeed", "deepspeed_config": ds},
                                       **precision), timeout=900)
        if proc.returncode:
            return s.record("deepspeed", False, f"ZeRO {stage} bf16 failed: {tail(proc)}")
        gap = max_gap(s.model(name), want)
        if gap > 5e-2:
            return s.record("deepspeed", False, f"ZeRO {stage}: max |diff| {gap:.2e} vs DDP bf16")
        notes.append(f"z{stage} {gap:.1e}")
        if stage == 2:
            notes.append(_srun_per_task(s, name))
    s.record("deepspeed", True, "max |diff| vs DDP bf16 (torchrun): " + ", ".join(notes))


def _srun_per_task(s: Smoke, name: str) -> str:
    """ZeRO 2 again, started by srun as one task per GPU (the per_task template's way), inside an allocation."""
    if not (shutil.which("srun") and os.environ.get("SLURM_JOB_ID")):
        return "srun: skipped (not inside a SLURM allocation)"
    config = os.path.join(s.out, name, "config.yaml")
    gpus = [] if s.cpu else ["--gpus-per-task=1"]
    proc = subprocess.run(["srun", f"--ntasks={s.world}", "--nodes=1", *gpus, sys.executable, "-m",
                           "launcher.worker", "--config", config], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=s.env())
    if proc.returncode:
        raise RuntimeError(f"srun per-task ZeRO 2 failed: {tail(proc)}")
    return "srun per-task z2 finished"


def check_timeout(s: Smoke) -> None:
    cfg = s.config("timeout", run={"epochs": 2}, distributed={"timeout_s": 10})  # NCCL collectives after the wait
    from launcher.config import load_config, write_resolved

    resolved = load_config(cfg)
    os.makedirs(resolved.run.output_dir, exist_ok=True)
    path = os.path.join(resolved.run.output_dir, "config.yaml")
    write_resolved(resolved, path)
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={s.world}", os.path.abspath(__file__), "--slow-save-worker",
                           "--config", path], cwd=ROOT, capture_output=True, text=True, timeout=900, env=s.env())
    took = time.time() - start
    s.record("timeout", proc.returncode == 0, f"rank 0 took 20 s over a checkpoint under a 10 s group timeout: "
                                              f"exit {proc.returncode} after {took:.0f} s"
                                              + ("" if proc.returncode == 0 else f"; {tail(proc)}"))


CHECKS = {"devices": check_devices, "engine": check_engine, "resume": check_resume, "deepspeed": check_deepspeed,
          "timeout": check_timeout}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="where runs go (default: a temporary directory, removed)")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--cpu", action="store_true", help="dry-run the script on 2 CPU processes (gloo)")
    parser.add_argument("--slow-save-worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.slow_save_worker:
        code = slow_save_worker(rest)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as launcher.worker does: skip finalization, where gloo's threads may abort the process
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_smoke: no CUDA device here: nothing was checked (run it on a GPU machine; see docs/gpu.md)")
        return 0
    world = 2 if args.cpu else torch.cuda.device_count()
    out = args.out or tempfile.mkdtemp(prefix="gpu-smoke-")
    os.makedirs(out, exist_ok=True)
    smoke = Smoke(out, world, args.cpu)
    where = "2 CPU processes (dry run)" if args.cpu else f"{world} x {torch.cuda.get_device_name(0)}"
    print(f"gpu_smoke: {where}; torch {torch.__version__}; runs in {out}", flush=True)
    names = args.only.split(",") if args.only else list(CHECKS)
    for name in names:
        try:
            CHECKS[name](smoke)
        except Exception as exc:  # noqa: BLE001 -- one broken check must not hide the others
            smoke.record(name, False, f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
    failed = [r for r in smoke.results if r[1] == "FAIL"]
    print(f"gpu_smoke: {len(smoke.results) - len(failed)} of {len(smoke.results)} checks did not fail"
          + (f"; FAILED: {', '.join(r[0] for r in failed)}" if failed else ""))
    if args.out is None and not failed:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
