"""The gradient noise scale, measured from what data-parallel accumulation already holds.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", App. A.1): with the squared norms of two mean
gradients over batches of B_small and B_big elements,

    |G|^2_est = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S_est     = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)          (an estimate of tr(Sigma))

are unbiased, and B_noise = tr(Sigma) / |G|^2 is the batch size beyond which a larger batch mostly wastes samples.
Both estimates are noisy, so the ratio is taken of their exponential moving averages, as the paper advises.

Where the two batch sizes come from, per window (one optimizer step):

* several ranks (DDP): the small batch is one rank's share of the window. At the window's last backward DDP hands
  each gradient bucket to our comm hook *before* its all-reduce; the bucket then holds this rank's accumulated
  gradient (earlier micro-batches stayed local under no_sync), and the hook takes the squared norm of each
  parameter's view of it there (memory that is in cache anyway, no extra pass over ``.grad``); the big batch is the
  same bucket once all-reduced, its norms taken in the all-reduce's completion callback.
* one process: the small batches are the window's micro-batches. A tensor hook on every parameter sees the gradient
  of each backward before it is added into ``.grad``, so its squared norm is taken there (one norm per parameter per
  micro-batch, the price of measuring without ranks). A window of one micro-batch has B_small = B_big and gives no
  estimate (null in metrics.jsonl).

Each rank's small-batch numbers go into one all-reduce of four float64 numbers per step (the only collective this
adds), together with the global squared norm, so every rank derives bit-identical statistics (the adaptive factor
depends on that).
"""
from __future__ import annotations

import math

import torch

from accum_sched import collective

#: metrics.jsonl fields, in the order they are written
FIELDS = ("gns_local_sq", "gns_global_sq", "gns_b_local", "gns_b_global", "gns_grad_sq", "gns_trace",
          "gns_grad_sq_ema", "gns_trace_ema", "noise_scale")


def unbiased_estimates(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float] | None:
    """(|G|^2, tr Sigma) estimates from mean gradients over ``b_small`` and ``b_big`` elements; None if undefined."""
    if not (b_big > b_small > 0) or not (math.isfinite(small_sq) and math.isfinite(big_sq)):
        return None
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


class NoiseScale:
    """Bias-corrected EMAs of the two estimates, and the noise scale as their ratio. Plain floats: its state_dict
    reproduces every later value bit for bit."""

    def __init__(self, ema: float = 0.95):
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema={ema!r} must be in [0, 1)")
        self.ema = float(ema)
        self.grad_sq = 0.0  # raw EMA accumulators; divided by (1 - ema^updates) when read
        self.trace = 0.0
        self.updates = 0

    def _corrected(self, value: float) -> float | None:
        return value / (1.0 - self.ema ** self.updates) if self.updates else None

    @property
    def noise_scale(self) -> float | None:
        """EMA(tr Sigma) / EMA(|G|^2) in elements; None before the first estimate or while EMA(|G|^2) <= 0."""
        if not self.updates or not self.grad_sq > 0:
            return None
        return self.trace / self.grad_sq  # the bias corrections cancel

    def update(self, local_sq: float, global_sq: float, b_local: float, b_global: float, use: bool = True) -> dict:
        """Feed one window; return its metrics fields (see FIELDS). ``use=False`` (a skipped step) reports the
        inputs but keeps them out of the EMAs."""
        est = unbiased_estimates(local_sq, global_sq, b_local, b_global) if use else None
        if est is not None:
            self.updates += 1
            self.grad_sq = self.ema * self.grad_sq + (1.0 - self.ema) * est[0]
            self.trace = self.ema * self.trace + (1.0 - self.ema) * est[1]
        return {"gns_local_sq": local_sq, "gns_global_sq": global_sq, "gns_b_local": b_local, "gns_b_global": b_global,
                "gns_grad_sq": None if est is None else est[0], "gns_trace": None if est is None else est[1],
                "gns_grad_sq_ema": self._corrected(self.grad_sq), "gns_trace_ema": self._corrected(self.trace),
                "noise_scale": self.noise_scale}

    def state_dict(self) -> dict:
        return {"ema": self.ema, "grad_sq": self.grad_sq, "trace": self.trace, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.grad_sq, self.trace = float(state["grad_sq"]), float(state["trace"])
        self.updates = int(state["updates"])


def _squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    # fp32 accumulation like the engine's global norm (a float64 norm is ~30x slower on CPU); squared in float64
    norm = torch.linalg.vector_norm(tensor, dtype=None if tensor.dtype == torch.float32 else torch.float32)
    return norm.double() ** 2


class _Probe:
    """Collects this rank's small-batch statistics of the open window: the sum over its small batches of
    |mean gradient|^2, how many small batches, and their elements."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self._sum = None  # float64 tensors, kept on their device (no host sync per micro-batch)
        self._count = None
        self._elements = None

    def _add(self, squares: list, n: torch.Tensor, multiplier: float) -> None:
        if not squares:
            return
        # tensor arithmetic only: n may live on the GPU and a host sync per micro-batch is what we avoid. A small
        # batch without elements has no mean gradient and counts for nothing.
        n = n.double()
        has = (n > 0).double()
        term = has * torch.stack(squares).sum().to(n.device) / (multiplier * multiplier) / n.clamp(min=1.0) ** 2
        self._sum = term if self._sum is None else self._sum + term
        self._count = has if self._count is None else self._count + has
        self._elements = n if self._elements is None else self._elements + n

    def take(self, device) -> list:
        """[sum, count, elements] of this window as float64 on ``device``; resets the probe."""
        zero = torch.zeros((), dtype=torch.float64, device=device)
        out = [zero if self._sum is None else self._sum.to(device),
               zero if self._count is None else self._count.to(device),
               zero if self._elements is None else self._elements.to(device)]
        self._reset()
        return out


class _WindowProbe(_Probe):
    """One small batch per rank and window: ``local`` is filled with per-parameter squared norms of this rank's
    accumulated gradient during the window's last backward, summed in parameter order at its end."""

    def __init__(self):
        super().__init__()
        self.local: dict[int, torch.Tensor] = {}
        self._window_n = None

    def after_backward(self, n: torch.Tensor, multiplier: float, boundary: bool) -> None:
        self._window_n = n if self._window_n is None else self._window_n + n.to(self._window_n.device)
        if boundary:
            local, self.local = self.local, {}
            self._add([local[i] for i in sorted(local)], self._window_n, multiplier)
            self._window_n = None


class BucketProbe(_WindowProbe):
    """DDP: one small batch per rank and window, from the buckets' gradients before their all-reduce.

    Norms are taken per parameter (the bucket's views) and summed in parameter order, for the local and for the
    reduced gradient alike: DDP rebuilds its buckets after the first backward of every new DDP object, so a norm
    per bucket would change in its last bits after a resume, and resumed decisions must repeat bit for bit.
    """

    def __init__(self, backend, params):
        super().__init__()
        self.index = {id(p): i for i, p in enumerate(params)}
        self.reduced: dict[int, torch.Tensor] = {}
        if not backend.observe_buckets(self._before, self._after):
            raise ValueError("noise_scale needs accum_sched's DDP comm hook (count_allreduce=True, no comm hook "
                             "of your own, a model not built with wrap_ddp): the local gradient is read from each "
                             "bucket before its all-reduce")

    def _before(self, bucket) -> None:  # comm hook, before the all-reduce: this rank's accumulated gradient
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            self.local[self.index[id(param)]] = _squared_norm(grad)

    def _after(self, bucket, reduced: torch.Tensor) -> None:  # the bucket once reduced (DDP's mean over ranks)
        offset = 0
        for param in bucket.parameters():
            self.reduced[self.index[id(param)]] = _squared_norm(reduced[offset:offset + param.numel()])
            offset += param.numel()

    def global_sq(self, multiplier: float) -> torch.Tensor | None:
        """|sum over ranks of the window's gradients|^2 x ``multiplier``^2, from the reduced buckets; resets."""
        reduced, self.reduced = self.reduced, {}
        if not reduced:
            return None
        return torch.stack([reduced[i] for i in sorted(reduced)]).sum() * (multiplier * multiplier)


class MicroBatchProbe(_Probe):
    """One process: each micro-batch is a small batch; its gradient's norm is taken in a hook on every parameter."""

    def __init__(self, params):
        super().__init__()
        self.squares: list[torch.Tensor] = []
        self.handles = [p.register_hook(self._grad) for p in params if p.requires_grad]

    def _grad(self, grad: torch.Tensor):
        self.squares.append(_squared_norm(grad))  # observes only: returns None, the gradient is unchanged

    def after_backward(self, n: torch.Tensor, multiplier: float, boundary: bool) -> None:
        squares, self.squares = self.squares, []
        self._add(squares, n, multiplier)


class AccumulatedGradProbe(_WindowProbe):
    """DeepSpeed ZeRO-0 in fp32: DeepSpeed all-reduces ``.grad`` after the window's last backward has finished, so
    a post-accumulate-grad hook on every parameter sees this rank's accumulated gradient just before. The hooks do
    nothing off the boundary (the back end's ``at_boundary``: it knows, from ``sync_context``, which micro-batch
    closes the window).
    """

    def __init__(self, backend, params):
        super().__init__()
        self.backend = backend
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)
                        if p.requires_grad]

    def _hook(self, index: int):
        def accumulated(param):
            if self.backend.at_boundary:
                self.local[index] = _squared_norm(param.grad)
        return accumulated


class WindowNoise:
    """What the engine holds with ``noise_scale=True``: the probe of its back end, and the EMAs."""

    def __init__(self, backend, ema: float = 0.95):
        self.estimator = NoiseScale(ema)
        params = backend.noise_params()  # where the local gradient is not at hand: ValueError
        how = "micro_batch" if backend.world_size == 1 else backend.capabilities.noise_scale
        if how == "micro_batch":
            self.probe = MicroBatchProbe(params)
        elif how == "accumulated_grad":
            self.probe = AccumulatedGradProbe(backend, params)
        elif how == "buckets":
            self.probe = BucketProbe(backend, params)
        else:
            raise ValueError(f"noise_scale is not measured with {backend.name}")

    def after_backward(self, n: torch.Tensor, multiplier: float, boundary: bool) -> None:
        self.probe.after_backward(n, multiplier, boundary)

    def finish_window(self, global_sq: float, coef: float, n_total: float, update: bool) -> dict:
        """The window's metrics fields; one all-reduce of four numbers.

        ``coef`` turns the back end's reduced gradient into the window's mean gradient; ``global_sq`` is the
        squared norm of that mean gradient as the engine took it, used unless the probe took its own from the
        reduced buckets. ``n_total``: the window's elements over all ranks. ``update=False`` (a skipped step)
        reports the inputs but keeps them out of the EMAs."""
        device = collective.comm_device()
        own = self.probe.global_sq(coef) if hasattr(self.probe, "global_sq") else None
        global_t = own.to(device) if own is not None else torch.tensor(global_sq, dtype=torch.float64, device=device)
        small_sum, count, elements = self.probe.take(device)
        # the global norm is summed too and divided by the world size, so that every rank holds the same bits
        # whatever the collective's rounding
        stats = collective.all_sum(torch.stack([small_sum, count, elements, global_t]))
        small_sum, count, elements, global_sum = stats.tolist()
        local_sq = small_sum / count if count else float("nan")
        b_local = elements / count if count else 0.0
        return self.estimator.update(local_sq, global_sum / collective.world_size(), b_local, float(n_total),
                                     use=update)

    def close(self) -> None:
        for handle in getattr(self.probe, "handles", ()):
            handle.remove()
