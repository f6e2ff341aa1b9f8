"""Preemption: SLURM warns a job with a signal (`#SBATCH --signal=USR2@90`, or `scancel --signal=USR2 JOBID`), and
Kubernetes or a local scheduler sends SIGTERM (`accum-sched run` forwards it to the workers,
launcher/launch/forward.py); the workers stop within about one micro-batch (the engine's stop_at="micro_batch";
DeepSpeed with fp16 weights: at the next optimizer boundary), commit a checkpoint holding the open window,
rank 0 requeues the job under SLURM, and every rank exits with status 0 (so torchrun does not restart the group). A
second SIGTERM ends a worker at once.

The signal handler only sets a flag and calls `engine.request_stop()` (itself only a flag): nothing else is safe in
the middle of a backward pass or a collective. The ranks agree on the stop in the engine's window-end collective,
so all of them stop after the same step even when the signal reached only some of them. The requeued job starts
the same script again and `--resume auto` continues from that checkpoint.

Which signal: ACCUM_SCHED_PREEMPT_SIGNAL (the sbatch templates export it; USR2 when unset). USR1 is left alone
by default because NCCL may use it. Under torchrun the signal also reaches torchrun itself, which forwards it to
the workers only when told (`--signals-to-handle=...,SIGUSR2`, as the torchrun template does) and otherwise dies.
Standard library only.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping

log = logging.getLogger("accum_sched.preempt")

ENV_SIGNAL = "ACCUM_SCHED_PREEMPT_SIGNAL"
DEFAULT_SIGNAL = "USR2"


def preempt_signal(environ: Mapping[str, str] = os.environ) -> signal.Signals:
    name = environ.get(ENV_SIGNAL, DEFAULT_SIGNAL).strip().upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"{ENV_SIGNAL}={environ.get(ENV_SIGNAL)!r} is not a signal name; use e.g. USR2") from None


class Preemption:
    """Install once, early (a signal may come while the model is still being built); `attach` the engine later."""

    def __init__(self, signum: signal.Signals):
        self.signum = signum
        self.received = False
        self._stop: Callable[[], None] | None = None

    @classmethod
    def install(cls, environ: Mapping[str, str] = os.environ, also: tuple = ()) -> Preemption:
        """Handle the preemption signal, and the signals in ``also`` (the worker passes SIGTERM) alike."""
        me = cls(preempt_signal(environ))
        signal.signal(me.signum, me._handler)
        for signum in also:
            if signum != me.signum:
                signal.signal(signum, me._handler_once)
        return me

    def _handler(self, signum, frame) -> None:
        self.received = True  # only flags here: the handler may run inside a backward pass or a collective
        if self._stop is not None:
            self._stop()

    def _handler_once(self, signum, frame) -> None:
        """SIGTERM: checkpoint and stop like the preemption signal; a second one ends the process at once (so a
        torchrun shutting down a failed group, or an impatient user, is not held up)."""
        signal.signal(signum, signal.SIG_DFL)
        self._handler(signum, frame)

    def attach(self, request_stop: Callable[[], None]) -> None:
        """Route the flag to the engine (`engine.request_stop`), passing on a signal that came before."""
        self._stop = request_stop
        if self.received:
            request_stop()


def requeue(environ: Mapping[str, str] = os.environ) -> bool:
    """`scontrol requeue $SLURM_JOB_ID` (rank 0 only, after the checkpoint is on disk). SLURM then ends this run
    of the job and starts it again later under the same job id. False (with the reason logged) outside SLURM or
    when scontrol refuses, e.g. a job submitted with --no-requeue."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        log.warning("preempted outside a SLURM job: checkpoint saved, nothing to requeue")
        return False
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("scontrol requeue %s failed: %s", job_id, exc)
        return False
    if done.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, (done.stderr or done.stdout).strip())
        return False
    return True
