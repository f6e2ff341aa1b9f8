"""The tests' own counters of host syncs and collectives: they watch torch, never the engine's counters.

* :class:`SyncCounter` wraps the tensor methods that read a tensor's value into Python (``item``, ``tolist``,
  ``numpy``, ``cpu``, ``__float__``, ``__int__``, ``__bool__``, ``__index__``) and counts every call made on behalf
  of ``accum_sched``: the nearest caller outside torch and DeepSpeed is an ``accum_sched`` module. So the engine's
  own reads count, and so do the ones it makes through torch: ``GradScaler.get_scale()``, the found-inf
  ``.item()`` of ``GradScaler.step``, an ``.item()`` inside ``torch.distributed``. A user's loss function is not
  the engine and is not counted. On CPU every read is counted as the stand-in for a device sync; which reads are of
  host memory by design (and so no device sync on a GPU either) is the test's to say, from what is recorded.
* :class:`CollectiveCounter` counts every collective, whichever way it is reached, once: the ``ProcessGroup``
  methods (what ``torch.distributed``'s functions, DDP comm hooks and FSDP2 call), the functional collectives
  (DTensor's), and, through a dispatch mode, the ``c10d`` ops that C++ launches itself (DDP's default hook, its
  bucket rebuild). The outermost counted call is the one recorded; the layers beneath it are its inner half.
  The dispatch mode is thread-local (autograd's threads inherit it): an op C++ launches from a thread of its own,
  outside any Python layer, would not be seen (none does on CPU/gloo).
"""
from __future__ import annotations

import inspect
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")
# modules a sync may pass through on its way from accum_sched (the engine calling torch, torch calling torch)
THROUGH = ("torch", "deepspeed")

# ProcessGroup methods that launch a collective -> the collective's name
PROCESS_GROUP_METHODS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "allgather": "all_gather",
    "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_single": "all_gather", "all_gather_single_coalesced": "all_gather", "_allgather_base": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "broadcast": "broadcast", "reduce": "reduce", "gather": "gather",
    "scatter": "scatter", "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "barrier": "barrier", "monitored_barrier": "barrier", "send": "send", "recv": "recv",
    "recv_anysource": "recv"}
# torch.distributed._functional_collectives (DTensor's redistribution) -> the collective's name
FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "broadcast": "broadcast",
    "all_gather_tensor": "all_gather", "all_gather_tensor_autograd": "all_gather", "all_gather_single": "all_gather",
    "all_gather_single_autograd": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_single_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_autograd": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all", "permute_tensor": "all_to_all"}


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _op_label(name: str) -> str | None:
    """A c10d / _c10d_functional op name -> the collective's name; None for ops that launch none (waits...)."""
    flat = name.replace("_", "")
    for key, label in (("allreduce", "all_reduce"), ("reducescatter", "reduce_scatter"), ("allgather", "all_gather"),
                       ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier"),
                       ("gather", "gather"), ("scatter", "scatter"), ("reduce", "reduce"), ("send", "send"),
                       ("recv", "recv")):
        if key in flat:
            return label
    return None


def _group_name(args) -> str | None:
    """The name of the process group a c10d op is given (as a boxed ScriptObject), if any."""
    import torch.distributed as dist

    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return dist.ProcessGroup.unbox(arg).group_name
    names = [arg for arg in args if isinstance(arg, str)]  # _c10d_functional ops: (..., reduce op, group name)
    return names[-1] if names else None


class SyncCounter:
    """Counts reads of tensor values into Python made on behalf of accum_sched, while installed.

    ``calls``: ``"<method> in <module>"`` per read (as before); ``details``: per read a dict with the method, the
    accum_sched function that caused it (``where``, a qualified name), the tensor's device, dtype and size."""

    def __init__(self):
        self.calls: list[str] = []
        self.details: list[dict] = []
        self._saved = {}
        self._inside = threading.local()

    def _caller(self):
        """(module, qualified function name) of the nearest frame outside torch/DeepSpeed and this file."""
        frame = sys._getframe(2)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module != __name__ and module.split(".")[0] not in THROUGH:
                return module, frame.f_code.co_qualname
            frame = frame.f_back
        return "", ""

    def __enter__(self):
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(tensor, *args, _original=original, _name=name, **kwargs):
                if getattr(self._inside, "depth", 0):  # a read inside a read (e.g. a subclass's tolist): once
                    return _original(tensor, *args, **kwargs)
                module, where = self._caller()
                if module.startswith("accum_sched"):
                    self.calls.append(f"{_name} in {module}")
                    self.details.append({"method": _name, "where": f"{module}.{where}", "device": str(tensor.device),
                                         "dtype": str(tensor.dtype), "numel": tensor.numel()})
                self._inside.depth = 1
                try:
                    return _original(tensor, *args, **kwargs)
                finally:
                    self._inside.depth = 0

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


class _C10dOps(TorchDispatchMode):
    """Sees the c10d ops that no Python layer above saw (launched from C++)."""

    def __init__(self, counter: CollectiveCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional") and not self.counter._depth():
            label = _op_label(func._opname)
            if label is not None:
                self.counter._record(label, _first_tensor(list(args)), _group_name(args), f"op {func}")
        return func(*args, **kwargs)


class CollectiveCounter:
    """Every collective launched while installed, once: ``calls`` holds ``(name, number of elements)`` (of the
    first tensor argument: the output of an all-gather / reduce-scatter), ``groups`` whether each ran on the
    default process group (``"world"``), another one (``"other"``, e.g. a side gloo group) or one not known
    (``"?"``: launched from C++), ``via`` the layer that saw it."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.groups: list[str] = []
        self.via: list[str] = []
        self._saved = []
        self._local = threading.local()
        self._mode = None

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _record(self, label, tensor, group_name, via):
        self.calls.append((label, tensor.numel() if isinstance(tensor, torch.Tensor) else 0))
        self.groups.append("?" if group_name is None else "world" if group_name == self._world else "other")
        self.via.append(via)

    def _wrap(self, owner, name, label, group_of, tensors_of):
        original = getattr(owner, name, None)
        if original is None:
            return
        # restored from the raw attribute: a pybind method read through getattr no longer binds ``self``
        self._saved.append((owner, name, vars(owner)[name] if isinstance(owner, type) else original))

        def wrapper(*args, **kwargs):
            if not self._depth():
                self._record(label, _first_tensor(tensors_of(args, kwargs)), group_of(args, kwargs),
                             f"{getattr(owner, '__name__', owner)}.{name}")
            self._local.depth = self._depth() + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth -= 1

        setattr(owner, name, wrapper)

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self._world = dist.distributed_c10d._get_default_group().group_name if dist.is_initialized() else None
        for method, label in PROCESS_GROUP_METHODS.items():
            self._wrap(dist.ProcessGroup, method, label, lambda a, k: a[0].group_name, lambda a, k: a[1:])

        def functional_group(function):
            signature = inspect.signature(function)

            def group_of(args, kwargs):
                try:
                    return funcol._resolve_group_name(signature.bind(*args, **kwargs).arguments["group"])
                except Exception:  # noqa: BLE001 -- an unusual group spec: counted, group unknown
                    return None

            return group_of

        for function, label in FUNCTIONAL.items():
            if hasattr(funcol, function):
                self._wrap(funcol, function, label, functional_group(getattr(funcol, function)),
                           lambda a, k: a[:1] or list(k.values())[:1])
        self._mode = _C10dOps(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
