"""The engine's DDP comm hook: a SUM all-reduce of each bucket, plus what the engine needs from that round.

* no division: DDP's own reduction divides every gradient by the world size as it copies it into the bucket; a
  Python comm hook gets the undivided copy, and dividing there would be one more pass over every gradient (about
  5% of a step of a 1M-parameter model on CPU, measured with bench/ab.py). The engine folds ``1 / world`` into the
  constant it multiplies each loss by (or into its one correction at the step), so the sum costs nothing;
* counts: gradient all-reduce rounds and bytes, as they are launched;
* the window's numbers (:mod:`accum_sched.window_stats`) ride at the end of one bucket of the boundary backward, so
  summing them over ranks costs no collective of its own. DDP reads each gradient from its offset in the tensor the
  hook's future returns, so the extra tail is simply ignored by DDP. The carrier is the smallest bucket of the
  previous round, or the last bucket if that one never came; every rank makes the same choice because DDP gives
  every rank the same buckets. The tail lives in the carrier's own storage, grown once (:meth:`HookState.carrier`),
  so carrying costs writing 8 numbers, not a copy of the bucket;
* the norm of each parameter's reduced gradient, when the engine asked for the norm of this window, taken in the
  future's callback while the backward still runs, with the bucket still in cache, and summed in the parameters'
  order (not the buckets'): DDP lays its buckets out again after the first iteration, and a norm taken per bucket
  would round differently before and after, so a run resumed from a checkpoint would not repeat the one that went
  straight on bit for bit;
* callbacks per bucket, before and after its reduction (``before_reduce(bucket)`` while the bucket holds this
  rank's own gradient, ``after_reduce(bucket, reduced_gradient)``), for measurements that want the gradient as it
  passes (the gradient noise scale's local norms). They run on the communication thread and must not wait for the
  device.
"""
from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Callable

import torch

from accum_sched import step_rules

BeforeReduce = Callable[[object], None]  # (bucket)
AfterReduce = Callable[[object, torch.Tensor], None]  # (bucket, its reduced gradient, without the stats' tail)


# DDP module -> the HookState of the engine hook registered on it. DDP takes one comm hook per module, for good:
# a later engine on the same module takes this state over (:func:`take_over`) instead of registering again.
_registered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class HookTakenOver(RuntimeError):
    """An engine whose DDP comm hook a later engine on the same model took over was used again."""


class HookState:
    """What the engine's comm hook reads and writes; one per DDP module."""

    _owner = None  # weak reference to the back end that drives the hook now (the latest engine on the module): a
    # strong one would tie the model to its own hook through DDP's C++ reducer, a cycle Python's GC cannot see

    @property
    def owner(self):
        return None if self._owner is None else self._owner()

    def __init__(self, process_group, parameters=()):
        self.order = {p: i for i, p in enumerate(parameters)}  # the order the squared norms are summed in
        self.process_group = process_group  # DDP's: the bucket all-reduce is launched on it directly, as torch's
        # own comm hooks do (torch.distributed.all_reduce would add ~20 us of Python checks per bucket)
        self.rounds = 0
        self.bytes = 0
        self.before_reduce: list[BeforeReduce] = []
        self.after_reduce: list[AfterReduce] = []
        self.want_norm = False  # take the norm of each reduced gradient in this round
        self.squared_norms: list[tuple[int, torch.Tensor]] = []  # (the parameter's place in self.order, its norm)
        self.pending_stats: torch.Tensor | None = None  # set before the boundary backward, appended to one bucket
        self.reduced_stats: torch.Tensor | None = None  # ... and summed over ranks by the end of that backward
        self._sizes: dict[int, int] = {}
        self._carrier = 0  # bucket index that carries the stats (the smallest of the previous round)
        self._grown = None  # (storage, offset, numel, dtype, tail) of the bucket whose storage holds the stats' tail
        self._grown_views: tuple[torch.Tensor, torch.Tensor] | None = None  # that storage as (bucket + tail, tail)
        # the carrier's buffer, kept: (bucket, stats) copied in, reduced in place
        self._flat: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None  # its (gradient, stats) views

    def carrier(self, buf: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``buf`` followed by ``stats`` in one tensor, and the view of its tail.

        Without a copy where it can: a DDP bucket owns its storage, which ends where the bucket does, so the first
        time the storage is grown by the tail in place (``resize_`` keeps the storage object, so DDP's views of it
        and every gradient that is a view of the bucket follow it to its new memory) and from then on the stats are
        written after the gradients and the two are reduced as one tensor, without copying the bucket. Otherwise
        (a bucket that shares its storage, or a storage that cannot grow) the bucket is copied into a buffer kept
        for it, with the stats after it (a fresh buffer per step would cost an allocation the size of the bucket)."""
        k = stats.numel()
        grown = self._in_place(buf, k)
        if grown is None:
            n = buf.numel()
            flat = self._flat
            if flat is None or flat.numel() != n + k or flat.dtype != buf.dtype or flat.device != buf.device:
                flat = self._flat = torch.empty(n + k, dtype=buf.dtype, device=buf.device)
                self._parts = (flat[:n], flat[n:])
            head, tail = self._parts
            head.copy_(buf)
        else:
            flat, tail = grown
        tail.copy_(stats)
        return flat, tail

    def _in_place(self, buf: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The bucket with ``k`` elements after it in its own storage (grown once), and the view of those ``k``; or
        None where that is unsafe. The two views are made once per grown storage and kept (making them costs
        ~20 us of CPU per step on the development machine): they hold the storage itself, not its memory, so
        they follow it, and holding it means no later storage can take its address while the key names it."""
        if not buf.is_contiguous():
            return None
        storage, size = buf.untyped_storage(), buf.element_size()
        offset, n = buf.storage_offset(), buf.numel()
        end = (offset + n) * size
        key = (storage._cdata, offset, n, buf.dtype, k)
        if key == self._grown and storage.nbytes() == end + k * size:
            return self._grown_views
        if storage.nbytes() != end:  # something else may live after the bucket: leave the storage alone
            return None
        try:
            storage.resize_(end + k * size)
        except RuntimeError:  # not resizable (memory it does not own)
            return None
        flat = buf.new_empty(0).set_(storage, offset, (n + k,), (1,))
        self._grown, self._grown_views = key, (flat, flat[n:])
        return self._grown_views

    def add_norms(self, bucket, grads: torch.Tensor) -> None:
        """Take the norm of each parameter's part of a reduced bucket (communication thread)."""
        params = bucket.parameters()
        views = [v for v in grads.split([p.numel() for p in params]) if v.numel()]
        keys = [self.order.get(p, len(self.order) + bucket.index()) for p in params if p.numel()]
        self.squared_norms.extend(zip(keys, step_rules.tensor_norms(views)))  # list.extend: safe across threads

    def take_norm(self) -> torch.Tensor | None:
        """The squared norm of the last reduced gradient (float64, on the device), or None if it was not taken."""
        norms, self.squared_norms = self.squared_norms, []
        if not norms:
            return None
        norms.sort(key=lambda pair: pair[0])  # stable: a parameter outside self.order keeps its bucket's order
        return torch.stack([norm.double() for _, norm in norms]).square().sum()


def installed(model) -> bool:
    """Whether the engine hook is registered on DDP ``model`` (by an earlier engine)."""
    return model in _registered


def install(model, owner) -> HookState:
    """The engine hook on DDP ``model``, driven by ``owner`` (a back end): registered on a first call; a later call
    for the same model takes the registered state over, as it is, reset for the new owner (the counters run on:
    the owner counts from where it took over). Raises RuntimeError, as DDP does, where a hook that is not ours is
    registered."""
    state = _registered.get(model)
    if state is None:
        state = HookState(model.process_group, model.parameters())
        model.register_comm_hook(state, engine_hook)
        _registered[model] = state
    else:
        state.before_reduce, state.after_reduce = [], []
        state.want_norm, state.squared_norms = False, []
        state.pending_stats = state.reduced_stats = None
    state._owner = weakref.ref(owner)
    return state


def _first(fut):
    return fut.value()[0]


# Every callback chained onto a bucket's future, until the communication thread has let go of it. That thread drops
# its reference after the callback has run, and needs the GIL to do so: if the bucket was the last of the last
# backward and the script ends at once, Python may already be finalizing, the thread is made to exit inside C++ code
# that must not unwind, and the process aborts ("terminate called without an active exception", seen in about one
# run in five of a short own loop under gloo). Before finalization an exit handler gives the thread the GIL until
# each callback is released.
_held: weakref.WeakSet = weakref.WeakSet()


def _then(fut, fn):
    """``fut.then(fn)`` with a callback object of its own, watched until the communication thread releases it."""
    def callback(f):
        return fn(f)

    _held.add(callback)
    return fut.then(callback)


def release_callbacks(timeout_s: float = 2.0) -> bool:
    """Wait (letting other threads run) until no chained callback is still held; True if none is."""
    deadline = time.monotonic() + timeout_s
    while len(_held) and time.monotonic() < deadline:
        time.sleep(0.001)
    return not len(_held)


atexit.register(release_callbacks)


def engine_hook(state: HookState, bucket):
    buf = bucket.buffer()
    index, last, n = bucket.index(), bucket.is_last(), buf.numel()
    state.bytes += n * buf.element_size()
    state._sizes[index] = n
    if last:  # one backward = one round, however many buckets it takes
        state.rounds += 1
    for callback in state.before_reduce:
        callback(bucket)
    carry = state.pending_stats is not None and (index == state._carrier or last)
    if carry:  # the tail holds the sums once DDP has waited for this bucket, at the backward's end
        flat, state.reduced_stats = state.carrier(buf, state.pending_stats)
        state.pending_stats = None
    else:
        flat = buf
    if last:
        state._carrier = min(state._sizes, key=state._sizes.get)
        state._sizes = {}
    fut = state.process_group.allreduce([flat]).get_future()
    want_norm, after = state.want_norm, state.after_reduce
    if not want_norm and not after:
        return _then(fut, _first)  # a Python hook's future must hold one tensor (torch asserts it)

    def reduced(fut):
        out = fut.value()[0]
        grads = out[:n] if carry else out
        if want_norm:
            state.add_norms(bucket, grads)
        for callback in after:
            callback(bucket, grads)
        return out

    return _then(fut, reduced)
