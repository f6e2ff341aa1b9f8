"""Issue 37, faults 1 and 5 (docs/reliability.md): a run killed while its workers still import torch leaves no
worker behind, and Ctrl-C (SIGINT to the process group) stops a run like SIGTERM: the open window committed, one
line with the resume hint, exit 130, no traceback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import paths
from launcher.checkpoint import store
from launcher.launch import forward

ROOT = paths.ROOT
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: {epochs}}}
task: {{target: builtin:regression, args: {{samples: 256}}}}
data: {{micro_batch_size: 16}}
accumulation: {{schedule: {{0: 2}}}}
optimizer: {{name: sgd, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain}}
"""
linux_only = pytest.mark.skipif(not os.path.isdir("/proc") or not sys.platform.startswith("linux"),
                                reason="prctl and /proc")


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _processes_naming(text: str, workers_only: bool = False) -> list[int]:
    """Live processes whose command line holds ``text`` (a run's own paths), zombies left out; ``workers_only``:
    the workers (torchrun's command line names the worker module too)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if workers_only and ("launcher.worker" not in argv or "torch.distributed.run" in argv):
            continue
        if text in argv and state != b"Z" and int(name) != os.getpid():
            found.append(int(name))
    return found


def _kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@linux_only
def test_a_worker_whose_torchrun_is_gone_ends_itself():
    """forward.guard_worker, alone: the pid handed down is checked against the parent's parent; a parent that is
    no child of it (torchrun died, the worker was reparented) ends the worker at once."""
    code = "from launcher.launch.forward import guard_worker; guard_worker(); print('survived', flush=True)"
    env = {**_env(), forward.LAUNCHER_PID_ENV: str(os.getpid())}  # our parent's parent is not us: gone
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout, (done.returncode, done.stdout)
    # started the way torchrun starts it (its parent is a child of the pid handed down): it carries on
    wrapper = ("import os, subprocess, sys; env = dict(os.environ, " + forward.LAUNCHER_PID_ENV + "=str(os.getppid()));"
               f" sys.exit(subprocess.run([sys.executable, '-c', {code!r}], env=env).returncode)")
    done = subprocess.run([sys.executable, "-c", wrapper], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "survived" in done.stdout, done.stderr


@linux_only
def _start_long_run(tmp_path, output=subprocess.PIPE) -> tuple[subprocess.Popen, object, object]:
    """`accum-sched run` of a 10000-epoch config in a session of its own (its process group, as a terminal's
    foreground job would be): (the process, its output_dir, the config path)."""
    out, cfg = tmp_path / "out", tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(out=out, epochs=10000))
    run = subprocess.Popen([sys.executable, "-m", "launcher", "run", str(cfg)], cwd=ROOT, env=_env(),
                           start_new_session=True, stdout=output, stderr=output, text=True)
    return run, out, cfg


def test_sigkill_of_the_process_group_while_workers_import_torch_leaves_no_worker(tmp_path):
    """The issue's probe: `setsid accum-sched run` and a `kill -9 -- -PGID` as soon as the workers exist (they are
    then importing torch, before any request of their own): none of them may live on, orphaned, retrying its
    TCPStore for minutes outside the directory's lock."""
    run, _, _ = _start_long_run(tmp_path, subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not workers and run.poll() is None:
            workers = _processes_naming(str(tmp_path), workers_only=True)
            time.sleep(0.05)
        assert workers, "no worker started"
        os.killpg(run.pid, signal.SIGKILL)  # accum-sched run and torchrun; the workers are in sessions of their own
        run.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _processes_naming(str(tmp_path)):
            time.sleep(0.1)
        left = _processes_naming(str(tmp_path))
        assert not left, f"orphaned: {left}"
    finally:
        _kill_all([run.pid, *_processes_naming(str(tmp_path))])


@linux_only
def test_sigint_to_the_process_group_commits_the_window_and_exits_130(tmp_path):
    """Ctrl-C: SIGINT to every process of the command's group (accum-sched run and torchrun). Before: 82 lines of
    KeyboardInterrupt tracebacks, exit 1, no checkpoint, no hint. Now as SIGTERM: the open window committed, one
    line naming `--resume`, exit 130, and the resume continues from that checkpoint."""
    run, out, cfg = _start_long_run(tmp_path)
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and run.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        assert run.poll() is None, run.communicate()[1][-3000:]
        os.killpg(run.pid, signal.SIGINT)
        stdout, stderr = run.communicate(timeout=180)
    finally:
        _kill_all([run.pid, *_processes_naming(str(tmp_path))])
    assert run.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-4000:]
    hint = [line for line in stderr.splitlines() if "--resume" in line]
    assert hint == [f"accum-sched: stopped by signal {int(signal.SIGINT)}: checkpoint committed; continue with "
                    f"`accum-sched run {cfg} --resume` (exit 130)"], stderr[-4000:]
    checkpoints = store.list_checkpoints(str(out / "checkpoints"))
    assert checkpoints, "no checkpoint committed"
    manifest, problem = store.verify(checkpoints[-1][1])
    assert problem is None
    with open(metrics) as f:
        last = json.loads(f.read().splitlines()[-1])["step"]
    assert manifest.step >= last  # the stop's checkpoint holds every step logged
    assert not _processes_naming(str(tmp_path)), "a process outlived the stop"


@pytest.mark.slow
@linux_only
def test_sigint_while_the_workers_import_torch_still_stops_the_run(tmp_path):
    """Ctrl-C about a second after the start, while the workers still import torch (and, as torchrun started them,
    ignore SIGINT): the command sends the stop again to each worker that ignored it until its handler is in place,
    so the run stops at its first step with a checkpoint and exit 130 instead of training on (10000 epochs)."""
    run, out, cfg = _start_long_run(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _processes_naming(str(tmp_path), workers_only=True):
            time.sleep(0.05)
        assert _processes_naming(str(tmp_path), workers_only=True), "no worker started"
        os.killpg(run.pid, signal.SIGINT)
        stdout, stderr = run.communicate(timeout=240)
    finally:
        _kill_all([run.pid, *_processes_naming(str(tmp_path))])
    assert run.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-4000:]
    checkpoints = store.list_checkpoints(str(out / "checkpoints"))
    assert checkpoints and store.verify(checkpoints[-1][1])[1] is None, stderr[-4000:]
    assert not _processes_naming(str(tmp_path)), "a process outlived the stop"


def test_a_late_ctrl_c_is_passed_on_once_the_handler_is_in_place():
    """The re-send's choice, on real processes: one that ignores SIGINT is remembered, not sent to; once it catches
    SIGINT it gets it, once; one that caught it all along (and got it the first time) is left alone."""
    script = ("import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print(1, flush=True); "
              "sys.stdin.readline(); signal.signal(signal.SIGINT, lambda *a: print('got', flush=True)); "
              "print(2, flush=True); time.sleep(60)")
    late_worker = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True)
    catching = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, "
                                 "lambda *a: None); print(1, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        late_worker.stdout.readline(), catching.stdout.readline()
        assert forward.disposition(late_worker.pid, signal.SIGINT) == "ignored"
        assert forward.disposition(catching.pid, signal.SIGINT) == "caught"
        late: set[int] = set()
        assert forward.pass_on_late(late, [late_worker.pid, catching.pid], signal.SIGINT) == [] and late == {
            late_worker.pid}
        late_worker.stdin.write("\n")
        late_worker.stdin.flush()
        assert late_worker.stdout.readline() == "2\n"
        assert forward.pass_on_late(late, [late_worker.pid, catching.pid], signal.SIGINT) == [late_worker.pid]
        assert late_worker.stdout.readline() == "got\n" and late == set()
        assert forward.pass_on_late(late, [late_worker.pid, catching.pid], signal.SIGINT) == []  # never twice
    finally:
        late_worker.kill(), catching.kill()
        late_worker.wait(), catching.wait()
