"""FSDP2 under `accum-sched run` (``distributed.backend: fsdp``): wrapping, sharded checkpoints, the final model.

``distributed.fsdp`` (its keys checked in launcher/config/schema.py, its rules in :class:`FSDPBackend`):

* ``wrap``: module class names whose instances are sharded one by one (children before parents), then the root;
  ``auto`` takes the model's ``_no_split_modules`` (Hugging Face models list their transformer blocks there) and
  shards only the root when it has none.
* ``reshard_after_forward`` (default true): wrapped blocks free their gathered parameters after the forward and
  gather them again for the backward; false keeps them gathered until then (memory for one all-gather less). The
  root follows FSDP2's own rule (kept gathered, as the backward starts with it) unless this is false.
* ``param_dtype`` / ``reduce_dtype``: FSDP2's MixedPrecisionPolicy (compute / gradient reduce-scatter dtype); the
  sharded parameters, the optimizer and the checkpoints stay fp32.
* ``cpu_offload``: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer step on the CPU).
* ``mesh``: null, one shard group of every rank (a 1-D mesh); ``[replicas, shards]``, HSDP on a 2-D mesh
  (``replicate`` x ``shard``; the product must be the world size, checked before launch). ``[1, world]`` is the
  1-D mesh.
* ``gradient_sync`` and ``keep_gathered`` go to the engine (accum_sched/backends/fsdp.py says what each does);
  ``reduce_scatter`` on a 1-D mesh has no all-reduce to defer and runs as ``every_micro_batch``.

``run.compile`` compiles per block, as torchtitan does: the forward of every module that is sharded before the
root is compiled in place (launcher/backends/compile.py) before fully_shard; the root's own layers around them
(embeddings, head) stay eager. A model with no such block is compiled whole. FSDP2's hooks stay outside the
compiled forward, so the all-gather and reduce-scatter run as they do eagerly (both orders, compile before and
after fully_shard, measured equal to eager on CPU/gloo).

Checkpoints: every rank writes its shards of the model and optimizer with torch.distributed.checkpoint (DCP) under
``<checkpoint>/fsdp/``, inside the temporary directory the Checkpointer commits atomically with its manifest. DCP
reshards on load, so a run may resume on another world size. ``model.pt`` is gathered into a plain fp32
state_dict on rank 0, with the same keys as the unsharded model.

torch is imported inside the functions: `accum-sched check` imports nothing from here.
"""
from __future__ import annotations

import os

from launcher.backends.base import LauncherBackend, OptimizerFactory, Setup
from launcher.backends.compile import compile_modules
from launcher.backends.compile import options as compile_options
from launcher.errors import CheckpointError, ConfigError
from launcher.options import Section, key, section

DIRNAME = "fsdp"  # the DCP files inside a checkpoint directory
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


# -- the options: distributed.fsdp (torch-free; launcher/config composes the section from the registry) ---------
DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


def wrap_value(v):
    if v == "auto":
        return None
    if isinstance(v, list) and v and all(isinstance(c, str) and c.strip() for c in v):
        return None
    return f"expected 'auto' or a non-empty list of module class names, got {v!r}"


def mesh_value(v):
    # the product's match with the world size is checked with the world (FSDPBackend.validate)
    if len(v) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in v):
        return None
    return f"expected null or two positive integers [replicas, shards], got {v!r}"


# distributed.fsdp (backend: fsdp; launcher/backends/fsdp.py applies them). Mixed precision changes the numbers;
# sync mode, mesh, keeping parameters gathered, wrapping and offload do not (an OOM may be answered by resuming with
# every_micro_batch; DCP reshards a checkpoint onto another mesh as onto another world size).
@section(path="distributed.fsdp")
class FSDPConfig(Section):
    gradient_sync: str = key("boundary", train=False, choices=("boundary", "every_micro_batch", "reduce_scatter"),
                             doc="`boundary`: gradient collectives only at the window's end; `every_micro_batch`: "
                                 "every micro-batch; `reduce_scatter`: reduce-scatter every micro-batch, all-reduce "
                                 "across replicas at the end (HSDP); see [FSDP2](fsdp.md)")
    mesh: list[int] | None = key(None, train=False, check=mesh_value, hint="write e.g. [2, 4], or null",
                                 doc="`[replicas, shards]` (HSDP: sharded inside each group of `shards` ranks, "
                                     "replicated across `replicas` groups; the product is the world size); null: "
                                     "one shard group of all ranks")
    keep_gathered: bool = key(False, train=False, doc="parameters stay gathered across a window's micro-batches "
                                                      "and are resharded at its end")
    # module class names to fully_shard one by one before the root, or auto: the model's _no_split_modules
    wrap: str | list[str] = key("auto", train=False, check=wrap_value, hint="write auto or e.g. [GPT2Block]",
                                doc="class names of the modules sharded one by one, or `auto`: the model's "
                                    "`_no_split_modules`")
    reshard_after_forward: bool = key(True, train=False, doc="free gathered parameters after the forward")
    param_dtype: str | None = key(None, train=True, choices=DTYPES,
                                  doc="compute dtype (FSDP2's `MixedPrecisionPolicy`); null: the parameters'")
    reduce_dtype: str | None = key(None, train=True, choices=DTYPES,
                                   doc="dtype of the gradient reduce-scatter; null: `param_dtype`")
    cpu_offload: bool = key(False, train=False, doc="FSDP2's `CPUOffloadPolicy`")


# the key of the distributed section this back end owns: (annotation, declaration)
OPTIONS = {"fsdp": (FSDPConfig, key(FSDPConfig, train=True, doc="FSDP2 settings (`backend: fsdp`)"))}


def wrap_classes(options: dict, model) -> list[str]:
    """The class names to shard before the root: the configured list, or the model's _no_split_modules (auto)."""
    wrap = options["wrap"]
    if wrap == "auto":
        return list(getattr(model, "_no_split_modules", None) or [])
    return list(wrap)


def blocks(model, names: list[str]) -> list:
    """The modules of ``model`` (the root excepted) whose class is one of ``names``, children before parents:
    reversed pre-order visits every block before any block that contains it."""
    return [m for m in reversed(list(model.modules())[1:]) if type(m).__name__ in names]


def compile_blocks(cfg, model) -> None:
    """``run.compile``: compile each block :func:`shard` will shard (the whole model when there is none); of
    nested blocks only the outer one, whose compiled forward takes in the inner ones."""
    opts = compile_options(cfg.run.compile)
    if opts is None:
        return
    sharded = blocks(model, wrap_classes(cfg.distributed.fsdp, model))
    inner = {id(m) for b in sharded for m in list(b.modules())[1:]}
    compile_modules([b for b in sharded if id(b) not in inner] or [model], opts)


def _dtype(name):
    # torch on the worker only: config validation imports this module on login nodes
    import torch

    return None if name is None else getattr(torch, _DTYPES[name])


def ensure_process_group() -> None:
    """FSDP2 needs a process group even for one worker started without torchrun (torchrun always gives one)."""
    # torch on the worker only: config validation imports this module on login nodes
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def shard(cfg, model, device):
    """Apply fully_shard to ``model`` as ``distributed.fsdp`` says; returns the root (the same object).

    Call before building the optimizer: fully_shard replaces the parameters by sharded DTensors.
    """
    # torch on the worker only: config validation imports this module on login nodes
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = cfg.distributed.fsdp
    ensure_process_group()
    replicas, shards = options["mesh"] or (1, dist.get_world_size())
    if replicas == 1:
        mesh = init_device_mesh(device.type, (shards,))
    else:  # FSDP2 shards on the last dimension and replicates on the first
        mesh = init_device_mesh(device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(param_dtype=_dtype(options["param_dtype"]),
                                  reduce_dtype=_dtype(options["reduce_dtype"]))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if options["cpu_offload"] else OffloadPolicy()
    names = wrap_classes(options, model)
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing and options["wrap"] != "auto":
        raise ConfigError("distributed.fsdp.wrap", f"the model has no module of class {', '.join(missing)}",
                          f"use class names of the model ({', '.join(sorted(present))}) or auto")
    reshard = options["reshard_after_forward"]
    for module in blocks(model, names):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    return fully_shard(model, mesh=mesh, reshard_after_forward=None if reshard else False, mp_policy=policy,
                       offload_policy=offload)


# -- checkpoints ------------------------------------------------------------------------------------------------
UNSTEPPED = "optimizer-unstepped"  # marker file: the optimizer had not stepped when the checkpoint was saved


def save(model, optimizer, path: str, group=None, background: bool = False):
    """Every rank writes its shards of model and optimizer under ``path`` (DCP). Collective. ``background``
    (checkpoint.async): DCP's async_save copies them to host memory now and writes them in its own thread,
    collective on ``group`` (a gloo group the training thread does not use); the returned callable waits for that
    write (a synchronous save returns one with nothing left to do)."""
    # torch on the worker only: config validation imports this module on login nodes
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # An optimizer that never stepped (a stop inside the first window) has no state. get_state_dict gives it one by
    # a zero-gradient step at lr 0 (Adam's step count 1) unless some .grad is set (an open window's shards), and
    # load() always does: so that state is saved (the open window's gradients held aside meanwhile), the live
    # optimizer is emptied again, and a marker makes load() empty the loaded one (else the resumed run would take its
    # first step as the second).
    unstepped = not optimizer.state
    params = [p for group_ in optimizer.param_groups for p in group_["params"]]
    held = [p.grad for p in params] if unstepped else []
    for p in params if unstepped else ():
        p.grad = None
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
    finally:
        for p, grad in zip(params, held):
            p.grad = grad
    state = {"model": model_state, "optimizer": optim_state}
    written = None
    if background:
        alone = not dist.is_initialized() or dist.get_world_size() == 1  # no peers: no group, no collectives
        written = dcp.async_save(state, checkpoint_id=path, process_group=group, no_dist=alone)  # staged on return
    else:
        dcp.save(state, checkpoint_id=path)
    if unstepped:
        optimizer.state.clear()
    rank = dist.get_rank() if dist.is_initialized() else 0

    def done() -> None:
        if written is not None:
            written.result()
        if unstepped and rank == 0:
            open(os.path.join(path, UNSTEPPED), "w").close()

    if not background:
        done()
    return done


def load(model, optimizer, path: str) -> None:
    """Read ``path`` (written by :func:`save`, possibly by another number of ranks) into model and optimizer."""
    # torch on the worker only: config validation imports this module on login nodes
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no FSDP2 shards in this checkpoint (was it saved by another back end?)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)  # in place, resharded to this world's layout
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if os.path.exists(os.path.join(path, UNSTEPPED)):  # saved before the first step (see save)
        optimizer.state.clear()


def consolidated_state_dict(model) -> dict | None:
    """The full model as a plain fp32 state_dict on rank 0 (None elsewhere). Collective."""
    # torch on the worker only: config validation imports this module on login nodes
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().cpu().clone() for k, v in full.items()}  # sharded parameters keep their fp32


# -- the launcher's back end ------------------------------------------------------------------------------------
class FSDPBackend(LauncherBackend):
    """FSDP2: the model sharded before its optimizer is built; checkpoints as DCP shards under ``fsdp/``."""

    name = "fsdp"
    invariant_sampler = True  # every rank runs its filler forwards (FSDP2 gathers in each): test_invariant_run.py
    sharded_checkpoint = True
    options = OPTIONS

    def validate(self, cfg) -> None:
        acc = cfg.accumulation
        if acc.noise_scale or acc.adaptive is not None:
            field = "accumulation.noise_scale" if acc.noise_scale else "accumulation.adaptive"
            raise ConfigError(field, "is not measured with backend: fsdp yet", "use backend ddp, or remove it")
        if cfg.run.precision == "fp16":
            raise ConfigError("run.precision", "fp16 is not supported with backend: fsdp (GradScaler would find "
                              "overflows per shard, so ranks could disagree)",
                              "use bf16, or distributed.fsdp.param_dtype")
        mesh, world = cfg.distributed.fsdp["mesh"], cfg.world_size
        if mesh is not None and mesh[0] * mesh[1] != world:
            raise ConfigError("distributed.fsdp.mesh", f"{mesh[0]} x {mesh[1]} ranks but the world has {world} "
                              f"(nnodes x nproc_per_node)", "make replicas x shards equal the world size, or null")

    def validate_unused(self, cfg) -> None:
        fsdp = cfg.distributed.fsdp
        if fsdp.to_dict() != type(fsdp)().to_dict():  # any key away from its default
            raise ConfigError("distributed.fsdp", f"is set but distributed.backend is {cfg.distributed.backend}",
                              "set distributed.backend: fsdp, or remove distributed.fsdp")

    def setup(self, cfg, model, make_optimizer: OptimizerFactory, device, world: int) -> Setup:
        compile_blocks(cfg, model)  # per block, before fully_shard (as torchtitan)
        root = shard(cfg, model, device)  # before the optimizer: fully_shard swaps the parameters for sharded ones
        optimizer, lr_scheduler = make_optimizer(root)
        from accum_sched.backends.fsdp import FSDPBackend as LibraryFSDP  # torch: workers only

        backend = LibraryFSDP(root, optimizer, lr_scheduler, precision=cfg.run.precision,
                              gradient_sync=cfg.distributed.fsdp["gradient_sync"],
                              keep_gathered=cfg.distributed.fsdp["keep_gathered"])
        return Setup(module=root, model=root, optimizer=optimizer, lr_scheduler=lr_scheduler,
                     engine_args={"backend": backend})

    def final_state_dict(self, setup: Setup, rank: int) -> dict | None:
        return consolidated_state_dict(setup.model)

    def save_shards(self, setup: Setup, directory: str) -> None:
        save(setup.model, setup.optimizer, os.path.join(directory, DIRNAME))

    def stage_shards(self, setup: Setup, directory: str, group):
        return save(setup.model, setup.optimizer, os.path.join(directory, DIRNAME), group, background=True)

    def load_shards(self, setup: Setup, directory: str) -> None:
        try:  # DCP reads the shards, resharded for this world size
            load(setup.model, setup.optimizer, os.path.join(directory, DIRNAME))
        except Exception as exc:  # name the checkpoint on every rank
            raise CheckpointError(f"{directory}: FSDP2 shards cannot be loaded ({type(exc).__name__}: {exc})") from exc
