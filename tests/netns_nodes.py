"""Several "machines" on one host for the SLURM fixture: one network namespace per node, each with its own address
and host name, all on one private bridge with the host.

    host  ── bridge <br> 10.A.B.1/24 ──┬── veth ── netns <node1>: eth0 10.A.B.11, lo, host name <node1>
                                       └── veth ── netns <node2>: eth0 10.A.B.12, lo, host name <node2>

A process started through `wrap(node, argv)` runs in its node's network namespace, in a fresh UTS namespace that
carries the node's host name, and in a private mount namespace where a hosts file of the cluster is bound over
/etc/hosts (so `<node2>` resolves to its address on `<node1>`, as on a real cluster; the host's own /etc is never
written). The namespaces have no default route: traffic stays between the bridge address and the nodes' own.
Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2's `ip`, util-linux's `unshare`; `NetnsUnavailable` says why
when something is missing. Every name carries this process's id, so two test sessions do not meet.

Nothing stays behind (issue 28): `start()` registers `stop()` to run at exit and on SIGTERM, SIGHUP and SIGINT
(then the signal takes its earlier course), and, since SIGKILL cannot be caught, first removes what killed runs
left: every namespace, bridge and veth of this project's names (`accum-<pid>-<i>`, `acb<pid>[x<k>]`, `acv<pid>h<i>`)
whose owner process <pid> is gone, and the processes still inside such a namespace (the dead run's own daemons).
Names of a live process, another test session's, are left alone. Several NetnsNodes may live in one process at
once (the SLURM cluster's and an elastic test's): the k-th one's bridge is `acb<pid>x<k>`, and the node numbers <i>
go on counting across them.
"""
from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path

NETNS_NAME = re.compile(r"accum-(\d+)-\d+")  # this project's namespaces; the number is the owner's process id
LINK_NAME = re.compile(r"ac(?:b(\d+)(?:x\d+)?|v(\d+)h\d+)")  # its bridges and host-side veths


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no interface or route of the host uses, chosen from the process id."""
    used = _ip("-4", "route", "show", "table", "all").stdout + _ip("-4", "-o", "addr").stdout
    taken = []
    for word in used.split():
        try:
            taken.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            pass
    seed = os.getpid()
    for k in range(200):
        n = (seed + 7919 * k) % (200 * 250)
        net = ipaddress.ip_network(f"10.{50 + n // 250}.{n % 250}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise NetnsUnavailable("no free 10.x.y.0/24 subnet for the test bridge")


def _alive(pid: int) -> bool:
    return pid == os.getpid() or os.path.exists(f"/proc/{pid}")


def _kill_inside(ns: str) -> None:
    """SIGKILL the processes inside namespace ``ns`` (one of this project's)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass


def remove_stale() -> list[str]:
    """Remove the namespaces, bridges and veths of this project whose owner process is gone (a run killed with
    SIGKILL), killing the processes left inside those namespaces first. Returns what was removed."""
    removed = []
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for ns in [line.split()[0] for line in listed if line.strip()]:
        m = NETNS_NAME.fullmatch(ns)
        if not m or _alive(int(m.group(1))):
            continue
        _kill_inside(ns)  # the dead run's daemons
        _ip("netns", "del", ns, check=False)
        removed.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@")[0]
        m = LINK_NAME.fullmatch(link)
        if m and not _alive(int(m.group(1) or m.group(2))):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


_cleanups: list = []  # stop() of every started NetnsNodes (and what else registered), newest last
_handled: dict = {}  # signal -> the handler it had before
_cleanups_registered: list = []  # [True] once _run_cleanups is an exit handler
_made_in_this_process = [0, 0]  # NetnsNodes made, nodes named: a second one's names must not meet the first's


def _run_cleanups() -> None:
    while _cleanups:
        fn = _cleanups.pop()
        try:
            fn()
        except Exception:  # noqa: BLE001 -- the next one must still run
            pass


def _on_signal(signum, frame):
    _run_cleanups()
    before = _handled.get(signum, signal.SIG_DFL)
    if callable(before):
        before(signum, frame)
        return
    if before != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)  # the signal's own course: usually the end of the process
        os.kill(os.getpid(), signum)


def on_exit(fn) -> None:
    """Run ``fn`` at exit and on SIGTERM / SIGHUP / SIGINT (before the handler the signal had), once."""
    if not _cleanups_registered:
        atexit.register(_run_cleanups)
        _cleanups_registered.append(True)
    _cleanups.append(fn)
    if not _handled and threading.current_thread() is threading.main_thread():  # signals: main thread only
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            _handled[signum] = signal.getsignal(signum)
            signal.signal(signum, _on_signal)


def forget(fn) -> None:
    """``fn`` ran already (a normal stop): drop it from the exit and signal cleanups."""
    if fn in _cleanups:
        _cleanups.remove(fn)


class NetnsNodes:
    """`nodes` namespaces on one bridge. `start()` builds them, `stop()` removes every one of them."""

    def __init__(self, root: str | Path, names: list[str]):
        self.root = Path(root)
        self.names = list(names)
        tag = str(os.getpid())  # the owner: remove_stale() tells a killed run's names by it (pid_max fits IFNAMSIZ)
        k, first = _made_in_this_process
        _made_in_this_process[:] = [k + 1, first + len(self.names)]
        self.bridge = f"acb{tag}" + (f"x{k}" if k else "")  # at most 15 characters (IFNAMSIZ) with a 7-digit pid
        self.netns = {name: f"accum-{tag}-{first + i}" for i, name in enumerate(self.names)}
        self.host_veth = {name: f"acv{tag}h{first + i}" for i, name in enumerate(self.names)}
        self.hosts_file = self.root / "hosts"
        self.host_name = socket.gethostname().split(".")[0]
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge_addr = ""
        self.addr: dict[str, str] = {}
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order

    def start(self) -> NetnsNodes:
        for tool in ("ip", "nsenter", "unshare", "mount"):
            if shutil.which(tool) is None:
                raise NetnsUnavailable(f"`{tool}` is not installed (iproute2 / util-linux)")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        remove_stale()  # what killed runs left
        on_exit(self.stop)
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.bridge_addr = str(hosts[0])
        self.addr = {name: str(hosts[10 + i]) for i, name in enumerate(self.names)}
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name in self.names:
            ns, veth = self.netns[name], self.host_veth[name]
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}n", "netns", ns)
            self._made.append(("link", veth))  # deleting one end removes the pair
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "link", "set", f"{veth}n", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost", f"{self.bridge_addr} {self.host_name}"]
        lines += [f"{addr} {name}" for name, addr in self.addr.items()]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        return self

    def wrap(self, node: str, argv: list[str]) -> list[str]:
        """argv that runs `argv` as node `node` (its network, its host name, the cluster's /etc/hosts). Each
        step execs the next, so the returned process id is that of `argv` itself."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        # nsenter, not `ip netns exec`: that one mounts a fresh /sys, without the cgroup file system slurmd needs.
        return ["nsenter", f"--net=/run/netns/{self.netns[node]}", "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", script, "sh", node, str(self.hosts_file), *argv]

    def stop(self) -> None:
        """Remove what start() made, newest first. Processes still inside a namespace (stopped on a signal before
        their owner could end them) are killed: only this run's own processes live there."""
        forget(self.stop)
        for kind, name in reversed(self._made):
            if kind == "netns":
                _kill_inside(name)
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()
