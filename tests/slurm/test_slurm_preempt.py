"""launcher.train.preempt in one process: a real signal only sets flags, reaches the engine once attached (also when it
came before), and requeue() outside SLURM says so instead of failing. The SLURM round trip is in test_slurm_e2e."""
from __future__ import annotations

import os
import signal

import pytest

from launcher.train.preempt import Preemption, preempt_signal, requeue

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)


def test_signal_sets_flags_before_and_after_attach():
    old = signal.getsignal(signal.SIGUSR1)
    try:
        pre = Preemption.install({"ACCUM_SCHED_PREEMPT_SIGNAL": "USR1"})
        assert pre.signum == signal.SIGUSR1 and not pre.received
        os.kill(os.getpid(), signal.SIGUSR1)  # before the engine exists (model still being built)
        assert pre.received
        stops = []
        pre.attach(lambda: stops.append(1))
        assert stops == [1]  # the early signal is passed on at attach time
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stops == [1, 1]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_signal_names_and_requeue_outside_slurm():
    assert preempt_signal({}) == signal.SIGUSR2
    assert preempt_signal({"ACCUM_SCHED_PREEMPT_SIGNAL": "SIGTERM"}) == signal.SIGTERM
    with pytest.raises(ValueError, match="ACCUM_SCHED_PREEMPT_SIGNAL='USR9' is not a signal name"):
        preempt_signal({"ACCUM_SCHED_PREEMPT_SIGNAL": "USR9"})
    assert requeue({}) is False
