"""The SLURM fixture's network namespaces do not outlive their test run (issue 28, item 5; tests/netns_nodes.py):
a run killed with SIGKILL leaves its namespaces, bridge, veths and a process inside one, and the next run's start
removes exactly those; a run stopped by SIGTERM removes its own before it ends. Needs root and `ip` (no SLURM)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import paths

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

# a run that builds two nodes, starts a process inside the first (as slurmd runs there), says so and waits
# (with "stop": stops at once instead); each in a process of its own, as test sessions are
HOLDER = """
import os, subprocess, sys, time
sys.path.insert(0, {tests!r})
from netns_nodes import NetnsNodes
os.makedirs({root!r}, exist_ok=True)
net = NetnsNodes({root!r}, ["n1", "n2"]).start()
inside = subprocess.Popen(net.wrap("n1", ["sleep", "300"]))
print(" ".join([*net.netns.values(), net.bridge, *net.host_veth.values(), str(inside.pid)]), flush=True)
if {stop!r}:
    inside.kill(); inside.wait(); net.stop(); sys.exit(0)
time.sleep(300)
"""


def _names() -> tuple[set, set]:
    netns = {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
             .stdout.splitlines() if line.strip()}
    links = {line.split(":")[1].strip().split("@")[0] for line in
             subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()}
    return netns, links


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie waiting for a parent that does not reap (a container's init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _holder(tmp_path, name: str, stop: bool = False):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(tests=paths.TESTS, root=str(tmp_path / name),
                                                                 stop=stop)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if not line:
        proc.wait(timeout=30)
        why = proc.stderr.read()
        if "NetnsUnavailable" in why:
            pytest.skip(f"network namespaces unavailable: {why.strip().splitlines()[-1]}")
        raise AssertionError(why)
    return proc, line[:2], line[2], line[3:5], int(line[5])


def test_a_killed_runs_namespaces_are_removed_by_the_next_start(tmp_path):
    proc, netns, bridge, veths, inside = _holder(tmp_path, "old")
    proc.kill()  # SIGKILL: no handler runs
    proc.wait(timeout=30)
    have_ns, have_links = _names()
    assert set(netns) <= have_ns and {bridge, *veths} <= have_links  # what the fault was: all of it stays behind
    assert os.path.exists(f"/proc/{inside}")

    live, live_netns, live_bridge, _, _ = _holder(tmp_path, "live")  # another session, running: not touched
    try:
        new, new_netns, _, _, _ = _holder(tmp_path, "new", stop=True)  # its start removes the stale ones
        assert new.wait(timeout=60) == 0, new.stderr.read()
        have_ns, have_links = _names()
        assert not set(netns) & have_ns and not {bridge, *veths} & have_links
        assert set(live_netns) <= have_ns and live_bridge in have_links
        assert not set(new_netns) & have_ns  # stopped normally: its own are gone too
        deadline = time.monotonic() + 10
        while not _gone(inside) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(inside)  # the process left inside the dead run's namespace was killed
    finally:
        live.send_signal(signal.SIGTERM)
        live.wait(timeout=30)
    assert not set(live_netns) & _names()[0]  # SIGTERM: the run removed its own


def test_sigterm_removes_the_runs_namespaces(tmp_path):
    proc, netns, bridge, veths, inside = _holder(tmp_path, "run")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the signal still ends the process
    have_ns, have_links = _names()
    assert not set(netns) & have_ns and not {bridge, *veths} & have_links
    deadline = time.monotonic() + 10
    while not _gone(inside) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(inside)  # what still ran inside went with them
