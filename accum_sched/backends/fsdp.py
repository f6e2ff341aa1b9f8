"""FSDP2 back end: the engine's windows on a model that ``torch.distributed.fsdp.fully_shard`` was applied to.

How a window runs, in the three gradient-sync modes. The mesh may be 1-D (one shard group of every rank) or 2-D,
``(replicas, shards)`` (HSDP: the parameters are sharded inside each shard group and replicated across the groups;
a gradient is reduce-scattered inside the shard group, then all-reduced across the replicas):

* ``boundary`` (default): non-boundary micro-batches run with ``set_requires_gradient_sync(False)``, so FSDP2 keeps
  each parameter's *unsharded* gradient on this rank and adds the next backward into it; the boundary micro-batch
  reduce-scatters (and, under HSDP, all-reduces) the window's sum once. No gradient collective off the boundary, a
  full-size gradient per rank.
* ``every_micro_batch``: every backward reduce-scatters and all-reduces, and FSDP2 adds the result into the
  *sharded* gradient. Only a 1/shards shard of the gradient is ever held (like ZeRO-2).
* ``reduce_scatter``: every backward reduce-scatters inside the shard group, and FSDP2 adds the result into a
  partial shard (``set_requires_all_reduce(False)``); only the boundary all-reduces it across the replicas. The
  shard-sized memory of ``every_micro_batch`` with the cross-replica traffic of ``boundary``. On a 1-D mesh there is
  no all-reduce to defer, and it is ``every_micro_batch``.

``keep_gathered``: every module keeps its gathered parameters from the window's first forward to its last backward
(``set_reshard_after_forward(False)``, and ``set_reshard_after_backward`` false off the boundary), so a window
all-gathers each parameter group once instead of once or twice per micro-batch, for the memory of the full
parameters held all window. The boundary backward reshards, so the optimizer steps the shards and the next window
gathers the new values.

Exactness: FSDP2's reduce-scatter averages over the ranks by default (ReduceOp.AVG, or a post-division by the world
size where the reduce dtype risks overflow), just like DDP's all-reduce (under HSDP the reduce-scatter averages over
the shard group and the all-reduce over the replicas: the world in all); the mean of sums is linear, so every mode
delivers (sum over the window on all ranks) / world and the engine's usual coefficient (world / global element count,
``averages_over_world``) turns it into the large-batch mean. A user-set ``set_gradient_divide_factor`` would change
that divisor, so it is refused.

At the boundary each rank holds a disjoint shard of the reduced gradient (a DTensor; ``to_local()`` is the shard).
The global norm is the square root of the sum over ranks of the squared local norms, summed in the same all-reduce as
the window's counts (one small all-reduce per step either way); under HSDP every replica holds the same shards, so
only the ranks of the first replica contribute theirs;
clipping and normalisation multiply the local shards in place, which scales the whole gradient. A rank whose shard
is empty (``Linear(5, 1)`` on 2 ranks) contributes zero and still takes part in the all-reduce.
"""
from __future__ import annotations

import dataclasses

import torch

from accum_sched import collective
from accum_sched.backends.torch_optim import TorchBackend
from accum_sched.step_rules import squared_norm

SYNC_MODES = ("boundary", "every_micro_batch", "reduce_scatter")


def fsdp_modules(model: torch.nn.Module) -> list:
    """Every module of ``model`` that fully_shard was applied to (the root first)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_groups(module) -> list:
    state = module._get_fsdp_state()
    return list(state._fsdp_param_groups)


class FSDPBackend(TorchBackend):
    """Drives an FSDP2 root module (``fully_shard(model)``) and a torch optimizer over its sharded parameters.

    Args:
        model: the root module, on which ``fully_shard`` was applied (after its blocks, if any).
        optimizer: a torch optimizer built on ``model.parameters()`` *after* sharding (DTensor parameters).
        precision: ``"fp32"`` or ``"bf16"`` (fp16's GradScaler is refused, see ``capabilities``).
        count_allreduce: accepted for the torch back ends' common spelling; the reduce-scatter rounds are always
            counted (:attr:`allreduce_rounds`).
        gradient_sync: ``"boundary"`` (default), ``"every_micro_batch"`` or ``"reduce_scatter"``, and
        keep_gathered: (default False), see the module docstring.
    """

    name = "FSDP2"
    # A stop inside a window saves this rank's accumulated gradient from where FSDP2 keeps it (its unsharded
    # accumulation, the sharded .grad or the HSDP partial shard; accum_sched.backends.fsdp_window). fp16 is
    # refused: GradScaler finds infs per shard, so ranks would disagree on skipping and on the scale. The noise
    # scale's probes read DDP buckets or whole local gradients, neither of which FSDP2 hands out.
    capabilities = dataclasses.replace(TorchBackend.capabilities, stop_mid_window=True, fp16="refused",
                                       noise_scale=None)
    averages_over_world = True

    def __init__(self, model, optimizer, lr_scheduler=None, *, precision: str = "fp32", count_allreduce: bool = True,
                 gradient_sync: str = "boundary", keep_gathered: bool = False):
        if gradient_sync not in SYNC_MODES:
            raise ValueError(f"gradient_sync={gradient_sync!r} is not one of {', '.join(SYNC_MODES)}")
        if precision == "fp16":
            raise ValueError("precision='fp16' (GradScaler) is not supported with FSDP2; use bf16 autocast or "
                             "MixedPrecisionPolicy(param_dtype=torch.bfloat16)")
        super().__init__(model, optimizer, lr_scheduler, precision=precision)
        self.gradient_sync = gradient_sync
        self.keep_gathered = bool(keep_gathered)
        self.world_size = collective.world_size()
        self._modules = fsdp_modules(model)
        self.replicas, self._replica_rank = self._check_mesh()
        if self.keep_gathered:  # gathered in the window's first forward, kept until its last backward
            for module in self._modules:
                module.set_reshard_after_forward(False, recurse=False)
        self._sync: tuple | None = None  # what the FSDP2 modules were last told (set only on a change)
        self._rounds = 0
        self._stats_group = collective.stats_group()

    def _check_mesh(self) -> tuple[int, int]:
        """(replicas, this rank's replica index) of the model's mesh, refusing what the engine cannot normalise: a
        mesh that does not cover every rank once, or a changed gradient divisor."""
        sizes = set()
        replica_rank = 0
        for module in self._modules:
            for group in _param_groups(module):
                factor = group.gradient_divide_factor
                if factor is not None and factor != self.world_size:
                    raise ValueError(f"set_gradient_divide_factor({factor}) was called on the FSDP2 model: the engine "
                                     f"normalises exactly and needs FSDP2's default mean over the {self.world_size} "
                                     f"ranks; remove that call")
                info = group.mesh_info
                replicas = getattr(info, "replicate_mesh_size", 1)
                sizes.add((replicas, info.shard_mesh_size))
                replica_rank = getattr(info, "replicate_mesh_rank", 0)
        if len(sizes) > 1:
            raise ValueError(f"the FSDP2 modules use different meshes {sorted(sizes)}: shard every module on one mesh")
        replicas, shards = sizes.pop() if sizes else (1, self.world_size)
        if replicas * shards != self.world_size:
            raise ValueError(f"the FSDP2 mesh covers {replicas} x {shards} ranks but the process group has "
                             f"{self.world_size}: use a 1-D mesh over every rank or a (replicas, shards) mesh of "
                             f"all of them")
        return replicas, replica_rank

    @property
    def allreduce_rounds(self) -> int:
        """Backward passes that reduce-scattered gradients (each is one reduce-scatter per FSDP2 parameter group)."""
        return self._rounds

    @property
    def allreduce_bytes(self) -> None:
        return None

    # -- per micro-batch ----------------------------------------------------------------------------------------
    def _flags(self, boundary: bool) -> tuple[bool, bool, bool]:
        """(reduce-scatter, all-reduce across replicas, reshard after backward) for a micro-batch."""
        reduce = boundary or self.gradient_sync != "boundary"
        all_reduce = boundary or self.gradient_sync == "every_micro_batch"
        return reduce, all_reduce, boundary or not self.keep_gathered

    def _set_sync(self, flags: tuple[bool, bool, bool]) -> None:
        if flags != self._sync:
            reduce, all_reduce, reshard = flags
            for module in self._modules:  # recurse=False each: one pass over the FSDP2 modules, not all modules
                module.set_requires_gradient_sync(reduce, recurse=False)  # sets the all-reduce flag too: then ours
                module.set_requires_all_reduce(reduce and all_reduce, recurse=False)
                module.set_reshard_after_backward(reshard, recurse=False)
            self._sync = flags

    def sync_context(self, boundary: bool):
        """Before the forward: FSDP2 reads the flags in its post-backward hooks, so set them for the whole
        micro-batch."""
        flags = self._flags(boundary)
        self._set_sync(flags)
        self._rounds += int(flags[0])
        return super().sync_context(boundary)

    # -- per window ---------------------------------------------------------------------------------------------
    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's shards of the reduced gradient (views: scaling them in place scales the DTensor)."""
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                out.append(g.to_local() if hasattr(g, "to_local") else g)
        return out

    stats_dtype = torch.float64

    def send_window_stats(self, stats: torch.Tensor, want_norm: bool) -> None:
        """Before the last backward: start summing the window's numbers (overlapping that backward), unless the
        norm is wanted, when they are summed after it together with the shards' squared norm (one all-reduce)."""
        self._stats = stats.to(collective.comm_device())
        self._stats_work = None if want_norm else collective.all_sum_async(self._stats, group=self._stats_group)

    def window_totals(self, want_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed window numbers, squared global norm if wanted): the shards are disjoint, so their squared norms
        add up over ranks to the full gradient's."""
        stats, work = self._stats, self._stats_work
        self._stats = self._stats_work = None
        if not want_norm:
            if work is not None:
                work.wait()
            return stats, None
        squared = squared_norm(self._grads(), stats.device)
        if self._replica_rank:  # the first replica's shards stand for the others' identical copies
            squared = torch.zeros_like(squared)
        both = collective.all_sum(torch.cat([stats, squared.reshape(1)]), group=self._stats_group)
        return both[:-1], both[-1]

    def _grads(self) -> list[torch.Tensor]:
        return [g for g in self._local_grads() if g.numel()]

    # -- an open window (stopped inside it): accum_sched.backends.fsdp_window ----------------------------------
    def local_grads(self) -> dict:
        """This rank's accumulated gradient of an open window, wherever FSDP2 keeps it (CPU tensors, per rank)."""
        from accum_sched.backends import fsdp_window

        return fsdp_window.save(self._modules, self.optimizer)

    def local_grad_tensors(self) -> list[torch.Tensor]:
        from accum_sched.backends import fsdp_window

        return fsdp_window.tensors(self._modules, self.optimizer)

    def load_local_grads(self, grads) -> None:
        from accum_sched.backends import fsdp_window

        fsdp_window.load(self._modules, self.optimizer, grads)


__all__ = ["FSDPBackend", "SYNC_MODES", "fsdp_modules"]
