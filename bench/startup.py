"""Start-up costs, each measured in a fresh interpreter (medians of a few runs):

- ``import accum_sched`` (must not import torch nor DeepSpeed) and ``accum_sched.AccumulationEngine`` (imports
  torch, still not DeepSpeed), next to ``import torch`` / ``lightning`` / ``accelerate`` for scale;
- ``accum-sched check CONFIG`` (must not import torch), if the subcommand exists;
- launch -> first worker process of ``accum-sched run CONFIG`` (the launcher's pre-launch work plus torchrun's
  start: what a login node waits for), and launch -> first optimizer step vs a plain torchrun script doing one DDP
  step.

``python bench/startup.py --first-worker [--runs N] [CONFIG]`` measures the first-worker time alone.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN_SCRIPT = os.path.join(ROOT, "bench", "plain_first_step.py")

_PROBE = """
import json, sys, time
t = time.perf_counter()
{code}
print(json.dumps({{"seconds": time.perf_counter() - t, "torch": "torch" in sys.modules,
                   "deepspeed": "deepspeed" in sys.modules}}))
"""


def _probe(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(code=code)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median_probe(code: str, env: dict, runs: int) -> dict:
    results = [_probe(code, env) for _ in range(runs)]
    return {"seconds": statistics.median(r["seconds"] for r in results), "torch": results[0]["torch"],
            "deepspeed": results[0]["deepspeed"]}


def imports(env: dict, runs: int) -> list[tuple[str, str]]:
    rows = []
    probes = [("import accum_sched", "import accum_sched"),
              ("accum_sched.AccumulationEngine", "import accum_sched; accum_sched.AccumulationEngine"),
              ("import torch", "import torch"),
              ("import lightning.pytorch", "import lightning.pytorch"),
              ("import accelerate", "import accelerate")]
    for label, code in probes:
        module = code.split()[1].split(";")[0].split(".")[0]
        if importlib.util.find_spec(module) is None:
            rows.append((label, f"skipped: {module} not installed"))
            continue
        try:
            r = _median_probe(code, env, runs)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rows.append((label, f"failed: {exc}"))
            continue
        rows.append((label, f"{r['seconds']:.2f} s; imports torch: {'yes' if r['torch'] else 'no'}; "
                            f"imports deepspeed: {'yes' if r['deepspeed'] else 'no'}"))
    return rows


def check_command(env: dict, config: str, runs: int) -> tuple[str, str]:
    label = f"accum-sched check {os.path.relpath(config, ROOT)}"
    if importlib.util.find_spec("launcher.cli.check") is None:
        return label, "skipped: the check subcommand does not exist yet"
    code = ("import io, contextlib; from launcher.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main(['check', {config!r}])\n"
            "assert rc == 0, rc")
    try:
        r = _median_probe(code, env, runs)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return label, f"failed: {exc}"
    return label, f"{r['seconds']:.2f} s; imports torch: {'yes' if r['torch'] else 'no'}"


def _first_line_time(cmd: list[str], path: str, env: dict, timeout: float) -> float | None:
    """Start ``cmd``; seconds until ``path`` holds a first complete line. The process is then left to finish."""
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty launch must never block on a full pipe
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen = None
    try:
        while time.time() - start < timeout:
            if seen is None and os.path.exists(path):
                with open(path) as f:
                    if "\n" in f.read():
                        seen = time.time() - start
            if proc.poll() is not None:
                break
            time.sleep(0.01)
        proc.wait(timeout=max(1.0, timeout - (time.time() - start)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # our own launch and its workers
        proc.wait()
    log.seek(0)
    tail = log.read().strip().splitlines()[-1:]
    log.close()
    if proc.returncode not in (0, None) and seen is None:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(tail)}")
    return seen


def _first_worker_time(cmd: list[str], marker: str, env: dict, timeout: float) -> tuple[float | None, float | None]:
    """Start ``cmd``; seconds until torchrun starts and until a process runs ``launcher.worker``, each found by
    polling /proc for ``marker`` (the run directory) in a command line (torchrun's own names the worker too: it
    counts as torchrun). The launch (its own session) is then stopped."""
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    torchrun = worker = None
    try:
        while worker is None and time.time() - start < timeout and proc.poll() is None:
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        line = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if "launcher.worker" not in line or marker not in line:
                    continue
                now = time.time() - start
                if "torch.distributed.run" in line:
                    torchrun = torchrun if torchrun is not None else now
                else:
                    worker = now
                    break
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # our own launch and its workers
        proc.wait()
    return torchrun, worker


def _median_row(times: list) -> str:
    found = sorted(t for t in times if t is not None)
    if not found:
        return "not seen"
    return f"{statistics.median(found):.2f} s (median of {len(found)}: {' '.join(f'{t:.2f}' for t in found)})"


def run_to_first_worker(env: dict, config: str, runs: int) -> list[tuple[str, str]]:
    label = f"accum-sched run {os.path.relpath(config, ROOT)}: launch ->"
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            run_dir = os.path.join(tmp, f"first{i}")
            cmd = [sys.executable, "-m", "launcher", "run", config, "--set", f"run.output_dir={run_dir}"]
            times.append(_first_worker_time(cmd, run_dir, env, 120))
    return [(f"{label} torchrun started (pre-launch work)", _median_row([t for t, _ in times])),
            (f"{label} first worker process", _median_row([w for _, w in times]))]


def run_to_first_step(env: dict, config: str, runs: int) -> list[tuple[str, str]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plain = []
        for i in range(runs):
            path = os.path.join(tmp, f"plain{i}.txt")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   PLAIN_SCRIPT, path]
            plain.append(_first_line_time(cmd, path, env, 300))
        rows.append(("plain torchrun script, 2 ranks: launch -> 1st step",
                     f"{statistics.median(p for p in plain if p is not None):.1f} s"
                     if any(p is not None for p in plain) else "failed"))
        label = f"accum-sched run {os.path.relpath(config, ROOT)}, 2 ranks: launch -> 1st step"
        if importlib.util.find_spec("launcher.cli.run") is None:
            rows.append((label, "skipped: the run subcommand does not exist yet"))
            return rows
        times = []
        try:
            for i in range(runs):
                run_dir = os.path.join(tmp, f"run{i}")
                cmd = [sys.executable, "-m", "launcher", "run", config, "--set", f"run.output_dir={run_dir}",
                       "--set", "run.epochs=1"]
                times.append(_first_line_time(cmd, os.path.join(run_dir, "metrics.jsonl"), env, 300))
        except RuntimeError as exc:
            rows.append((label, f"failed: {exc}"))
            return rows
        found = [t for t in times if t is not None]
        rows.append((label, f"{statistics.median(found):.1f} s (first line of metrics.jsonl)" if found
                     else "no metrics.jsonl line seen"))
    return rows


def measure(runs: int = 3, config: str | None = None) -> list[tuple[str, str]]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    config = config or os.path.join(ROOT, "configs", "demo.yaml")
    rows = imports(env, runs)
    if os.path.exists(config):
        rows.append(check_command(env, config, runs))
    else:
        rows.append(("accum-sched check", f"skipped: {config} not found"))
    rows += run_to_first_worker(env, config, runs)
    rows += run_to_first_step(env, config, runs)
    return rows


def render(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=os.path.join(ROOT, "configs", "demo.yaml"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--first-worker", action="store_true", help="only launch -> first worker process")
    a = parser.parse_args()
    environ = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    rows = run_to_first_worker(environ, a.config, a.runs) if a.first_worker else measure(a.runs, a.config)
    print(render(rows))
