"""A real SLURM cluster of two nodes on one machine for tests: munged, slurmctld and two slurmd as root, all state
in one directory.

Each slurmd runs in its own network namespace with its own host name and address (tests/netns_nodes.py: a private
bridge, veth pairs, a hosts file bound over /etc/hosts inside), so a two-node job really spans two "machines":
the head node found by `scontrol show hostnames`, a c10d rendezvous and gloo traffic across addresses, srun
steps on both nodes. munged and slurmctld run on the host; the namespaces reach munged through its socket file and
slurmctld through the bridge address. Nothing listens beyond 127.0.0.1, the bridge and the namespaces.

Tests set it up themselves (CI runs as root on a fresh machine): `ensure_slurm()` apt-get installs Debian's
`slurm-wlm`, `munge` and `iproute2` when a binary is missing, `SlurmCluster` writes a slurm.conf and a munge key
under its directory, starts the daemons in the foreground (so their pids are ours to stop), waits until both nodes
are idle, and on exit cancels what is left, stops exactly the daemons it started and removes the namespaces and
the bridge.
Clients (sbatch, srun, scontrol) find the cluster through `cluster.env` (SLURM_CONF). A one-node job lands on
either node; `--nodes=2` uses both.

Use it as the `slurm` pytest fixture (`from slurm_cluster import slurm  # noqa: F401`), or from a shell to poke
at it by hand: `python tests/slurm_cluster.py` starts one, prints the SLURM_CONF to export, and runs until
Ctrl-C or SIGTERM.

Whether the tests run (`slurm_required()`): where SLURM can be had, i.e. as root (the daemons and the namespaces
need it) with the binaries installed or apt-get to install them, they run, and a failed install or start-up is a
test failure, not a skip, so the README's plain `python -m pytest -q` cannot pass without them by accident. Elsewhere
(another user, no apt-get and no SLURM) they skip with the reason. ACCUM_SCHED_REQUIRE_SLURM=1 (CI) requires them
everywhere; ACCUM_SCHED_REQUIRE_SLURM=0 skips them when they cannot start (e.g. a container without the
privilege to make network namespaces).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netns_nodes import NetnsNodes, NetnsUnavailable, forget, on_exit

# iproute2: `ip` builds the nodes' namespaces (a slim container may lack it; util-linux's nsenter/unshare are
# essential packages).
PACKAGES = ("slurm-wlm", "munge", "iproute2")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "ip")
# Debian puts the daemons in /usr/sbin, which a non-login PATH may lack.
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
# A requeued job may start again only after the job credential's lifetime (AuthInfo cred_expire, default 120 s);
# short here so the preemption test does not idle for two minutes.
CRED_EXPIRE_S = 10


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started on this machine; the message says why."""


def _path_with_sbin() -> str:
    parts = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(parts + [p for p in SBIN if p not in parts])


def _which(name: str) -> str | None:
    return shutil.which(name, path=_path_with_sbin())


def _apt_get(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=timeout)


def ensure_slurm() -> None:
    """Install slurm-wlm, munge and iproute2 with apt-get when any binary is missing; raise SlurmUnavailable if
    that fails."""
    missing = [b for b in BINARIES if _which(b) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and not root, so apt-get cannot install "
                               f"{' '.join(PACKAGES)}")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed and there is no apt-get")
    install = ("install", "-y", "-q", "--no-install-recommends", *PACKAGES)
    done = _apt_get(*install, timeout=600)
    if done.returncode != 0:  # a fresh machine has no package lists yet
        _apt_get("update", "-q", timeout=600)
        done = _apt_get(*install, timeout=600)
    missing = [b for b in BINARIES if _which(b) is None]
    if done.returncode != 0 or missing:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed ({' | '.join(tail)}); "
                               f"still missing: {', '.join(missing) or 'nothing'}")


def slurm_required() -> tuple[bool, str]:
    """(required, why): whether a cluster that fails to come up is a test failure here, and the reason in words."""
    forced = os.environ.get("ACCUM_SCHED_REQUIRE_SLURM")
    if forced in ("0", "1"):
        return forced == "1", f"ACCUM_SCHED_REQUIRE_SLURM={forced}"
    if os.geteuid() != 0:
        return False, "not root: slurmctld, slurmd and the nodes' network namespaces need root"
    if any(_which(b) is None for b in BINARIES) and shutil.which("apt-get") is None:
        return False, "SLURM is not installed and there is no apt-get to install it"
    return True, "root, with SLURM installed or apt-get to install it"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NODES = ("accnode1", "accnode2")


class SlurmCluster:
    """One controller on this host and two compute nodes in network namespaces. `start()`/`stop()`, or use it as
    a context manager. `nodes` are the node (and host) names, `addr[node]` their addresses."""

    def __init__(self, root: str | Path, cpus: int | None = None):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.nodes = NODES
        self.net = NetnsNodes(self.root, list(NODES))
        self.addr: dict[str, str] = {}
        # Every node claims the host's cores: a two-node job then fits even on a 2-core machine.
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge-run" / "munge.socket"
        self.munge_key = self.root / "munge-etc" / "munge.key"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), PATH=_path_with_sbin())
        # Variables of an enclosing job would leak into sbatch/srun of the test's own jobs.
        for name in [n for n in self.env if n.startswith("SLURM_") and n != "SLURM_CONF"]:
            del self.env[name]
        self._procs: list[tuple[str, subprocess.Popen]] = []

    # -- set-up --------------------------------------------------------------------------------------------------
    def _write_files(self) -> None:
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        (self.root / "spool").mkdir(exist_ok=True)
        (self.root / "log").mkdir(exist_ok=True)
        # munged refuses a socket directory others can write to and a key others can read.
        self.munge_socket.parent.mkdir(mode=0o755, exist_ok=True)
        self.munge_key.parent.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.munge_socket.parent, 0o755)
        os.chmod(self.munge_key.parent, 0o700)
        fd = os.open(self.munge_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        ctld_port, slurmd_port = _free_port(), _free_port()  # slurmd: the same port in each namespace
        r = self.root
        lines = [
            "ClusterName=accumtest",
            f"SlurmctldHost={self.host}({self.net.bridge_addr})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobRequeue=1",
            # Scan pending jobs every second: a requeued job becomes eligible on a timer, not on an event.
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            "ReturnToService=2",
            "MailProg=/bin/true",
            "KillWait=10",  # SIGTERM .. SIGKILL when a job ends or is cancelled
            "MinJobAge=600",  # keep finished jobs visible to scontrol for the test's checks
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            # %n: the node's name, so the two slurmd sharing this file system keep apart
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            *(f"NodeName={node} NodeAddr={self.addr[node]} CPUs={self.cpus} State=UNKNOWN" for node in self.nodes),
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        for node in self.nodes:
            (r / "spool" / node).mkdir(exist_ok=True)
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, start_new_session=True)
        log.close()
        self._procs.append((name, proc))

    def _check_alive(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{name} exited with status {proc.returncode}: {self._log_tail(name)}")

    def _log_tail(self, name: str, lines: int = 5) -> str:
        text = ""
        for path in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"):
            if path.exists():
                text += path.read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:])

    def start(self, timeout: float = 60) -> SlurmCluster:
        ensure_slurm()
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.net.start()
        except NetnsUnavailable as why:
            raise SlurmUnavailable(f"cannot build the two nodes' network namespaces: {why}") from None
        on_exit(self.stop)  # at exit or SIGTERM/SIGHUP/SIGINT: the daemons first, then the namespaces (issue 28)
        self.addr = dict(self.net.addr)
        self._write_files()
        self._spawn("munged", [_which("munged"), "--foreground", "--force",
                               f"--socket={self.munge_socket}", f"--key-file={self.munge_key}",
                               f"--pid-file={self.root / 'munge-run' / 'munged.pid'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--seed-file={self.root / 'munge-etc' / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged socket")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", self.net.wrap(node, [_which("slurmd"), "-D", "-f", str(self.conf),
                                                                "-N", node]))
        self._wait(lambda: all(self.node_state(n) == "IDLE" for n in self.nodes), timeout, "both nodes idle")
        return self

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if ready():
                return
            time.sleep(0.2)
        slurmd = "; ".join(f"{n}: {self._log_tail(f'slurmd-{n}')}" for n in self.nodes)
        raise SlurmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}; "
                               f"slurmctld: {self._log_tail('slurmctld')}; slurmd {slurmd}")

    # -- client helpers ------------------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster."""
        return subprocess.run(list(argv), env=kw.pop("env", self.env), capture_output=True, text=True,
                              check=check, timeout=timeout, **kw)

    def on_node(self, node: str, *argv: str, check: bool = True, timeout: float = 30,
                **kw) -> subprocess.CompletedProcess:
        """Run a command as node `node` (its network namespace, host name and hosts file)."""
        return self.run(*self.net.wrap(node, list(argv)), check=check, timeout=timeout, **kw)

    def node_state(self, node: str) -> str:
        out = self.run("sinfo", "-h", "-n", node, "-o", "%T", check=False, timeout=10)
        return out.stdout.strip().upper().rstrip("*~#$@+^-!%") if out.returncode == 0 else ""

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, Reason, ...); empty once forgotten."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False, timeout=10)
        info: dict[str, str] = {}
        for field in out.stdout.split():
            key, sep, value = field.partition("=")
            if sep:
                info.setdefault(key, value)
        return info

    def wait_job(self, job_id: str, states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                 "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"),
                 timeout: float = 300, poll: float = 0.5) -> dict[str, str]:
        """Wait until the job is in one of `states`; return its last `scontrol show job` record."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout:.0f} s: {info.get('JobState')} "
                           f"({info.get('Reason')}); slurmctld: {self._log_tail('slurmctld', 10)}")

    # -- teardown ------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        forget(self.stop)
        if any(name == "slurmctld" and p.poll() is None for name, p in self._procs):
            # Jobs first, so slurmd's step daemons end the job processes before slurmd itself goes.
            self.run("scancel", "--full", "-u", "root", check=False, timeout=10)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                q = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.5)
        for _name, proc in reversed(self._procs):  # slurmds, slurmctld, munged: each only the one we started
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self._procs.clear()
        self.net.stop()  # after the slurmds: nothing of ours is left inside the namespaces

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def slurm_cluster(cpus: int | None = None):
    """A started cluster in a fresh temporary directory, removed afterwards."""
    root = tempfile.mkdtemp(prefix="accum-slurm-")
    try:
        with SlurmCluster(root, cpus=cpus) as cluster:
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)


# One cluster per test session: each test module imports the fixture, which makes a separate fixture definition
# per module, so the cluster itself is shared here.
_SESSION: dict = {}

try:  # the pytest fixture; this module also runs without pytest (see __main__ below)
    import pytest

    @pytest.fixture(scope="session")
    def slurm():
        if not _SESSION:
            try:
                ctx = slurm_cluster()
                _SESSION.update(cluster=ctx.__enter__(), ctx=ctx)
            except SlurmUnavailable as why:
                _SESSION["unavailable"] = str(why)
        if "unavailable" in _SESSION:
            why = _SESSION["unavailable"]
            required, because = slurm_required()
            if required:
                pytest.fail(f"SLURM required here ({because}) but unavailable: {why} "
                            f"(ACCUM_SCHED_REQUIRE_SLURM=0 skips the SLURM tests instead)")
            pytest.skip(f"SLURM unavailable: {why} (not required: {because})")
        yield _SESSION["cluster"]
        ctx = _SESSION.pop("ctx", None)  # at session end; the first module's finaliser stops it
        if ctx is not None:
            ctx.__exit__(None, None, None)
except ImportError:  # pragma: no cover
    pass


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    if sys.argv[1:] == ["--install"]:  # .ci/run: install the packages up front, out of the tests' timeouts
        ensure_slurm()
        print(f"accum-sched: SLURM present ({_which('slurmctld')})", flush=True)
        sys.exit(0)
    # explicit handlers: a background job (`... &`) starts with SIGINT ignored
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    with slurm_cluster() as c:
        states = ", ".join(f"{n} ({c.addr[n]}) {c.node_state(n)}" for n in c.nodes)
        print(f"export SLURM_CONF={c.conf}   # nodes {states}; Ctrl-C or SIGTERM stops it", flush=True)
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass
