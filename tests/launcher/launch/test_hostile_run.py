"""Hostile use of `accum-sched run` (issue 28.5, docs/reliability.md): an output_dir that is a file, two runs on one
output_dir, and a SIGKILL of the command itself, which must leave no torchrun agent or worker behind."""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import paths
from launcher import cli
from launcher.launch import forward, rundir, torchrun

ROOT = paths.ROOT
CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: {epochs}}}
task: {{target: builtin:regression, args: {{samples: 256}}}}
data: {{micro_batch_size: 16}}
accumulation: {{schedule: {{0: 1}}}}
optimizer: {{name: sgd, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 2}}
logging: {{progress: plain}}
"""


def write(tmp_path, out, epochs=1):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(out=out, epochs=epochs))
    return str(path)


@pytest.mark.parametrize("where", ["output_dir", "under_output_dir", "checkpoint_dir"])
def test_a_file_where_a_directory_belongs_is_one_line_exit_2(tmp_path, capsys, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory\n")
    out, sets = str(blocker), []
    if where == "under_output_dir":
        out = str(blocker / "run")
    elif where == "checkpoint_dir":
        out, sets = str(tmp_path / "out"), ["--set", f"checkpoint.dir={blocker}"]
    assert cli.main(["run", write(tmp_path, out), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    field = "checkpoint.dir" if where == "checkpoint_dir" else "run.output_dir"
    assert len(err) == 1 and err[0].startswith(f"error: {field}: ") and "not a directory; " in err[0], err
    assert blocker.read_text() == "not a directory\n" and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_output_dir_held_by_another_run_is_refused_naming_its_pid(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / rundir.LOCK, os.O_RDWR | os.O_CREAT)  # another run's lock, as rundir.hold leaves it
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"pid 4242 on node7 since 2026-01-01 00:00:00\n")
    try:
        assert cli.main(["run", write(tmp_path, str(out))]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is in use by another `accum-sched run` (pid 4242 on node7 since" in err[0], err
        assert "another run.output_dir" in err[0]
        assert sorted(os.listdir(out)) == [rundir.LOCK]  # nothing launched, nothing written
    finally:
        os.close(fd)
    rundir.release(rundir.hold(str(out)))  # free once its holder closed it
    # nodes of one multi-node run share the directory, each with a lock of its own
    fds = [rundir.hold(str(out), nnodes=2, node_rank=r) for r in (0, 1)]
    for fd in fds:
        rundir.release(fd)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
            tree.setdefault(ppid, []).append(int(name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"  # a zombie has ended


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.skipif(not os.path.isdir("/proc") or not sys.platform.startswith("linux"), reason="prctl and /proc")
@pytest.mark.slow
def test_sigkill_of_accum_sched_run_leaves_no_worker_and_frees_the_directory(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "launcher", "run", write(tmp_path, str(out), epochs=10000)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, workers = time.monotonic() + 180, []
        while time.monotonic() < deadline and len(workers) < 2:
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            agent = [p for p in _descendants(first.pid) if b"torch.distributed.run" in _cmdline(p)]
            workers = [w for a in agent for w in forward.worker_pids(a)]
            time.sleep(0.5)
        assert len(workers) == 2, "the workers did not start"
        # a second run on the same directory is refused while the first trains
        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and f"in use by another `accum-sched run` (pid {first.pid} on" in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        deadline = time.monotonic() + 60  # torchrun winds its workers down (SIGTERM: they may checkpoint first)
        while time.monotonic() < deadline and any(_alive(p) for p in workers + agent):
            time.sleep(0.2)
        left = [p for p in workers + agent if _alive(p)]
        assert not left, f"orphaned: {[_cmdline(p) for p in left]}"
    finally:
        for pid in [first.pid, *_descendants(first.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 30  # no stale lock: the next run may start (once the last holder has exited)
    while True:
        try:
            rundir.release(rundir.hold(str(out)))
            break
        except rundir.ConfigError:
            lock = str(out / rundir.LOCK)
            holders = [_cmdline(int(p)) for p in os.listdir("/proc") if p.isdigit() and _holds(int(p), lock)]
            assert time.monotonic() < deadline, f"the lock is still held by {holders}"
            time.sleep(0.2)


def _holds(pid: int, path: str) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl")
@pytest.mark.slow
def test_a_worker_dies_with_its_torchrun(tmp_path):
    """launcher/worker.py's request, alone: the child of a SIGKILLed parent gets SIGKILL from the kernel."""
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import os, time; from launcher.launch.forward import "
            "die_with_parent; die_with_parent(9, os.getppid()); print(os.getpid(), flush=True); time.sleep(600)'],"
            " stdout=subprocess.PIPE)\n"
            "print(child.stdout.readline().decode().strip(), flush=True); time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the child outlived its parent"


def test_a_rendezvous_port_in_use_here_is_one_line_exit_2(tmp_path, capsys):
    """torchrun would connect to whatever listens there and wait silently until its timeout (tried: 100 s, no
    output); the run stops before launch naming the holder and a free port instead."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = write(tmp_path, str(tmp_path / "out"))
        assert cli.main(["run", cfg, "--rdzv-endpoint", f"127.0.0.1:{port}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"error: --rdzv-endpoint: port {port} on 127.0.0.1 is in use by "), err
        assert f"pid {os.getpid()}: " in err[0] and "pick a free port, e.g. 127.0.0.1:" in err[0], err
        assert not (tmp_path / "out").exists()
        torchrun.check_endpoint(f"127.0.0.1:{port}", nnodes=2, node_rank=1)  # node 1 connects there: not checked
        torchrun.check_endpoint(f"10.255.255.1:{port}")  # not an address of this host: another node serves it
    torchrun.check_endpoint(f"127.0.0.1:{port}")  # free again
    with pytest.raises(torchrun.ConfigError, match="outside 1..65535"):
        torchrun.check_endpoint("127.0.0.1:70000")


def test_the_lock_ends_with_the_command_also_in_process(tmp_path, capsys):
    out = tmp_path / "out"
    # refused after the lock was taken (a --resume that does not exist): the directory is free again at once
    assert cli.main(["run", write(tmp_path, str(out)), "--resume", str(tmp_path / "nope")]) == 2
    assert "error: --resume: " in capsys.readouterr().err
    assert rundir.held() == ()
    fd = os.open(out / rundir.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process could take it now
    finally:
        os.close(fd)
