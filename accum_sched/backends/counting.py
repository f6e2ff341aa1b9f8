"""A counting-only DDP comm hook: DDP's own all-reduce, counted (benchmarks and tests count hand-written loops).

``model.register_comm_hook(CountingState(), counting_allreduce)`` leaves the gradients exactly as DDP's default
reduction makes them (the mean over ranks) and counts rounds and bytes as the engine's own hook does.
"""
from __future__ import annotations


class CountingState:
    """State of the counting-only DDP comm hook."""

    def __init__(self):
        self.rounds = 0
        self.bytes = 0
        # optional callbacks around each bucket's all-reduce (accum_sched.noise_scale): before(bucket) sees this
        # rank's own gradient, after(bucket, reduced) the all-reduced one
        self.before_reduce = None
        self.after_reduce = None


def counting_allreduce(state: CountingState, bucket):
    """DDP's default all-reduce hook (the mean), counting one round per backward and every bucket's bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.bytes += buf.numel() * buf.element_size()
    if state.before_reduce is not None:
        state.before_reduce(bucket)
    if bucket.is_last():  # one backward = one round, however many buckets it takes
        state.rounds += 1
    future = default_hooks.allreduce_hook(None, bucket)
    if state.after_reduce is not None:
        after = state.after_reduce

        def observe(fut):
            reduced = fut.value()
            after(bucket, reduced)
            return reduced

        future = future.then(observe)
    return future


__all__ = ["CountingState", "counting_allreduce"]
