"""DeepSpeed under `accum-sched run` (``distributed.backend: deepspeed``).

``distributed.deepspeed_config`` is the path of a DeepSpeed JSON file (relative to the working directory) or the
same content as an inline mapping. A user's existing JSON works as it is; accum-sched owns the batch arithmetic:

* ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` and ``train_batch_size`` are filled in from
  ``data.micro_batch_size``, the schedule and the world size, and kept true at every factor change. Values the JSON
  already has must agree with them at every piece of the schedule (checked before launch, naming the epoch).
* with no schedule in the YAML, the JSON's ``gradient_accumulation_steps`` (or ``train_batch_size``) becomes the
  constant factor; the schedule may also be written in the JSON under our key ``"accum_sched": {"schedule": {...},
  "unit": "epoch"}``, which is removed before DeepSpeed sees the config.
* ``gradient_clipping``: DeepSpeed clips at 1.0 when the key is absent; accum-sched clips only when asked
  (``optimizer.max_grad_norm``, or ``gradient_clipping`` in the JSON), so an absent key means no clipping.
* the JSON's ``optimizer`` / ``scheduler`` sections, when present, replace the YAML's optimizer / LR scheduler.

No torch or deepspeed import at module level: `accum-sched check` validates on login nodes.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

from accum_sched.schedule import AccumulationSchedule
from launcher.backends.base import LauncherBackend, OptimizerFactory, Setup
from launcher.errors import CheckpointError, ConfigError
from launcher.options import key as declare_key

FIELD = "distributed.deepspeed_config"
OUR_KEY = "accum_sched"  # {"schedule": ..., "unit": ...} inside the DeepSpeed JSON; DeepSpeed never sees it
OUR_FIELDS = ("schedule", "unit")
TAG = "deepspeed"  # DeepSpeed's own checkpoint files: <checkpoint>/deepspeed/

# the key of the distributed section this back end owns: (annotation, declaration); launcher/config composes it
OPTIONS = {"deepspeed_config": (Any | None, declare_key(
    None, train=True, doc="DeepSpeed JSON path or inline mapping; see [DeepSpeed](deepspeed.md)"))}


# -- reading: once per process -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeepSpeedJson:
    """The DeepSpeed config of a run, parsed and checked once: ``config`` without our key (read-only: copy it before
    changing it), ``ours`` our key's content (``schedule``, ``unit``), ``source`` the file it came from (or None)."""

    config: dict
    ours: dict
    source: str | None


_PARSED: dict = {}  # cache key -> DeepSpeedJson: a worker validates, resolves and builds from the same parse


def parse(cfg) -> DeepSpeedJson:
    """``distributed.deepspeed_config`` read, parsed and split into DeepSpeed's part and ours (cached per file
    version or inline content)."""
    source = cfg.distributed.deepspeed_config
    if isinstance(source, dict):
        key = ("inline", json.dumps(source, sort_keys=True, default=str))
    elif isinstance(source, str) and os.path.isfile(source):
        info = os.stat(source)
        key = ("file", os.path.abspath(source), info.st_mtime_ns, info.st_size)
    else:
        key = None  # an error below; nothing to cache
    if key is not None and key in _PARSED:
        return _PARSED[key]
    data = load_json(cfg)
    ours = _ours(data)
    parsed = DeepSpeedJson(config=data, ours=ours, source=source if isinstance(source, str) else None)
    _PARSED[key] = parsed
    return parsed


def load_json(cfg) -> dict:
    """The DeepSpeed config as a fresh dict (from the file, or a copy of the inline mapping)."""
    source = cfg.distributed.deepspeed_config
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if not isinstance(source, str):
        raise ConfigError(FIELD, f"expected a path or a mapping, got {source!r}",
                          "give the path of a DeepSpeed JSON file or write its content inline")
    if not os.path.isfile(source):
        raise ConfigError(FIELD, f"file {source!r} not found", "check the path (relative to where you run accum-sched)")
    with open(source, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(FIELD, f"JSON syntax error in {source} at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                          "fix the JSON at that position") from None
    if not isinstance(data, dict):
        raise ConfigError(FIELD, f"{source} holds a {type(data).__name__}, not a JSON object",
                          "a DeepSpeed config is an object: {\"zero_optimization\": {\"stage\": 2}, ...}")
    return data


def _ours(ds: dict) -> dict:
    """Our key of the JSON, checked (and removed from ``ds``)."""
    ours = ds.pop(OUR_KEY, None)
    if ours is None:
        return {}
    if not isinstance(ours, dict):
        raise ConfigError(f"{FIELD}.{OUR_KEY}", f"expected an object, got {ours!r}",
                          'write "accum_sched": {"schedule": {"0": 1, "4": 2}}')
    for key in ours:
        if key not in OUR_FIELDS:
            raise ConfigError(f"{FIELD}.{OUR_KEY}.{key}", "unknown key", f"known keys: {', '.join(OUR_FIELDS)}")
    if "schedule" in ours:
        try:
            AccumulationSchedule(ours["schedule"], ours.get("unit", "epoch"))
        except ValueError as exc:
            raise ConfigError(f"{FIELD}.{OUR_KEY}.schedule", str(exc), "write e.g. {\"0\": 1, \"4\": 2}") from None
    return ours


# -- resolving (launcher.config.validate calls it: the resolved config.yaml then holds the real schedule) --------
def resolved_raw(cfg) -> dict | None:
    """``cfg`` as a raw dict with the schedule the DeepSpeed JSON gives (our key, or a constant
    ``gradient_accumulation_steps``) moved into ``accumulation`` and a file path made absolute, for
    launcher.config to validate again; None when nothing changes. The one place the two schedules are compared."""
    parsed = parse(cfg)
    ours, acc = parsed.ours, cfg.accumulation
    raw = cfg.to_dict()
    changed = False
    source = cfg.distributed.deepspeed_config
    if isinstance(source, str) and not os.path.isabs(source):
        raw["distributed"]["deepspeed_config"] = os.path.abspath(source)  # workers and resumes may run elsewhere
        changed = True
    if "schedule" in ours:
        unit = ours.get("unit", acc.unit)
        if acc.global_batch is not None:
            raise ConfigError(f"{FIELD}.{OUR_KEY}.schedule", "is given together with accumulation.global_batch",
                              "keep one of them")
        if acc.schedule is not None and (AccumulationSchedule(acc.schedule, acc.unit)
                                         != AccumulationSchedule(ours["schedule"], unit)):
            raise ConfigError(f"{FIELD}.{OUR_KEY}.schedule",
                              f"{ours['schedule']} ({unit}) differs from accumulation.schedule {acc.schedule} "
                              f"({acc.unit})", "keep the schedule in one place")
        if acc.schedule is None:
            raw["accumulation"].update(schedule=ours["schedule"], unit=unit)
            changed = True
    elif acc.schedule is None and acc.global_batch is None:
        factor = _constant_factor(parsed.config, cfg)
        if factor is not None:  # an existing JSON's fixed accumulation becomes the (constant) schedule
            raw["accumulation"]["schedule"] = factor
            changed = True
    return raw if changed else None


def _constant_factor(ds: dict, cfg) -> int | None:
    gas = ds.get("gradient_accumulation_steps")
    if isinstance(gas, int) and not isinstance(gas, bool) and gas >= 1:
        return gas
    tbs = ds.get("train_batch_size")
    micro = ds.get("train_micro_batch_size_per_gpu", cfg.data.micro_batch_size)
    if isinstance(tbs, int) and isinstance(micro, int) and micro > 0 and tbs % (micro * cfg.world_size) == 0:
        return max(1, tbs // (micro * cfg.world_size))
    return None


# -- checking before launch (each check one concern; validate runs them all) -----------------------------------
def validate(cfg, world_size: int | None) -> None:
    """Check the DeepSpeed config against the run config; raise ConfigError naming the field and the numbers.

    ``world_size`` None skips the checks that need it (the world is known only at launch). The schedule written in
    both places was compared when the config was resolved (resolved_raw).
    """
    ds = parse(cfg).config
    _check_batch_keys(cfg, ds, world_size)
    _check_precision(ds, cfg.run.precision)
    _check_clipping(cfg, ds)
    _check_accumulation_and_zero(ds)
    _check_optimizer_owner(cfg, ds)


def _pieces(schedule: AccumulationSchedule, epochs: int) -> list[tuple[str, int]]:
    """("epoch 4", factor) for every constant piece of the schedule that the run reaches."""
    pairs = list(schedule.milestones)
    if not pairs or pairs[0][0] > 0:
        pairs.insert(0, (0, 1))
    if schedule.unit == "epoch":
        pairs = [(k, f) for k, f in pairs if k < epochs] or pairs[:1]
    return [(f"{schedule.unit} {key}", factor) for key, factor in pairs]


def _int_key(ds: dict, key: str) -> int | None:
    value = ds.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{FIELD}.{key}", f"expected an integer >= 1, got {value!r}",
                          "remove it: accum-sched fills it in from the schedule")
    return value


def _check_batch_keys(cfg, ds: dict, world_size: int | None) -> None:
    """The JSON's micro-batch, accumulation steps and global batch agree with every piece of the schedule."""
    micro = cfg.data.micro_batch_size
    ds_micro = _int_key(ds, "train_micro_batch_size_per_gpu")
    if ds_micro is not None and ds_micro != micro:
        raise ConfigError(f"{FIELD}.train_micro_batch_size_per_gpu",
                          f"{ds_micro} disagrees with data.micro_batch_size = {micro}",
                          "remove it from the DeepSpeed JSON (accum-sched fills it in) or make the two equal")
    gas, tbs = _int_key(ds, "gradient_accumulation_steps"), _int_key(ds, "train_batch_size")
    if world_size is None or (gas is None and tbs is None):
        return
    for where, factor in _pieces(cfg.schedule_for(world_size), cfg.run.epochs):
        want = micro * factor * world_size
        numbers = f"micro {micro} x factor {factor} x world {world_size} = {want}"
        if gas is not None and gas != factor:
            key, problem = "gradient_accumulation_steps", (
                f"{gas} disagrees with the schedule at {where} (factor {factor}): train_batch_size "
                f"{tbs if tbs is not None else micro * gas * world_size} vs {numbers}")
        elif tbs is not None and tbs != want:
            key, problem = "train_batch_size", (
                f"{tbs} disagrees with the schedule at {where}: train_batch_size {tbs} vs {numbers}")
        else:
            continue
        raise ConfigError(f"{FIELD}.{key}", problem,
                          "remove gradient_accumulation_steps and train_batch_size from the DeepSpeed JSON: "
                          "accum-sched sets them from the schedule at every factor change")


def _enabled(ds: dict, *keys: str) -> bool:
    return any(isinstance(ds.get(k), dict) and bool(ds[k].get("enabled", False)) for k in keys)


def _check_precision(ds: dict, precision: str) -> None:
    """run.precision and the JSON's fp16 / bf16 sections say the same thing."""
    bf16, fp16 = _enabled(ds, "bf16", "bfloat16"), _enabled(ds, "fp16")
    if precision == "fp16":  # name the JSON field that disagrees: that is what the user has to change
        if bf16:
            key = "bf16" if _enabled(ds, "bf16") else "bfloat16"
            raise ConfigError(f"{FIELD}.{key}.enabled", "is true but run.precision is fp16",
                              f"set \"{key}\": {{\"enabled\": false}} and \"fp16\": {{\"enabled\": true}}, or "
                              f"run.precision: bf16")
        if not fp16:
            state = "missing" if "fp16" not in ds else "false"
            raise ConfigError(f"{FIELD}.fp16.enabled", f"is {state} but run.precision is fp16 (DeepSpeed's loss "
                              f"scaler must own fp16 training)", "add \"fp16\": {\"enabled\": true} to the DeepSpeed "
                              "JSON, or use run.precision: bf16")
        zero = ds.get("zero_optimization")
        stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
        if not stage:  # measured with 0.19.8 (docs/gpu.md): its FP16 optimizers are not ZeRO optimizers
            raise ConfigError(f"{FIELD}.zero_optimization.stage", f"is {stage} with fp16, where DeepSpeed never "
                              "multiplies the loss by its loss scale but divides the gradient by it (every update "
                              "1/loss-scale too small)", "use ZeRO stage 1, 2 or 3 with fp16, or run.precision: bf16")
        return
    if bf16 and precision != "bf16":
        raise ConfigError("run.precision", f"is {precision} but the DeepSpeed JSON enables bf16 weights",
                          "set run.precision: bf16 (the forward then runs under bf16 autocast)")
    if fp16:
        raise ConfigError("run.precision", f"is {precision} but the DeepSpeed JSON enables fp16",
                          "set run.precision: fp16")


def _check_clipping(cfg, ds: dict) -> None:
    """One clipping threshold: the JSON's gradient_clipping or optimizer.max_grad_norm."""
    clip = ds.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise ConfigError(f"{FIELD}.gradient_clipping", f"expected a number >= 0, got {clip!r}", "e.g. 1.0, or 0")
    max_norm = cfg.optimizer.max_grad_norm
    if clip and max_norm is not None and float(clip) != max_norm:
        raise ConfigError(f"{FIELD}.gradient_clipping", f"{clip} differs from optimizer.max_grad_norm {max_norm}",
                          "clip in one place: remove one of them")


def _check_accumulation_and_zero(ds: dict) -> None:
    """What the back end cannot drive: unmanaged accumulation, unknown ZeRO stages, optimizer offload."""
    if ds.get("managed_gradient_accumulation") is False:
        raise ConfigError(f"{FIELD}.managed_gradient_accumulation", "false is not supported",
                          "remove it: accum-sched sets DeepSpeed's accumulation boundary itself")
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{FIELD}.zero_optimization", f"expected an object, got {zero!r}", '{"stage": 2}')
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"{FIELD}.zero_optimization.stage", f"{stage!r} is not 0, 1, 2 or 3", "choose a stage")
    offload = zero.get("offload_optimizer")
    if isinstance(offload, dict) and offload.get("device", "none") not in (None, "none"):
        raise ConfigError(f"{FIELD}.zero_optimization.offload_optimizer", "is not supported yet",
                          "remove it (the accumulation engine scales gradients in the ZeRO partitions)")


def _trivial_lr_scheduler(cfg) -> bool:
    section = cfg.lr_scheduler
    return section is None or (section.name == "constant" and section.warmup_steps == 0)


def _check_optimizer_owner(cfg, ds: dict) -> None:
    """A YAML LR scheduler cannot drive an optimizer or scheduler the JSON brings."""
    if _trivial_lr_scheduler(cfg):
        return
    if "scheduler" in ds:
        raise ConfigError("lr_scheduler", f"{cfg.lr_scheduler.name} is given and the DeepSpeed JSON has a "
                          "\"scheduler\" too", "keep one: set lr_scheduler: null, or remove the JSON's scheduler")
    if "optimizer" in ds:
        raise ConfigError("lr_scheduler", f"{cfg.lr_scheduler.name} would drive accum-sched's optimizer, but the "
                          "DeepSpeed JSON brings its own \"optimizer\"",
                          "add a \"scheduler\" to the DeepSpeed JSON and set lr_scheduler: null")


# -- on the worker ----------------------------------------------------------------------------------------------
def deepspeed_config(cfg, world_size: int, client_optimizer: bool) -> dict:
    """The dict handed to DeepSpeed: the user's JSON without our key, batch sizes at the first factor, clipping as
    configured (DeepSpeed's silent default of 1.0 turned off)."""
    ds = copy.deepcopy(parse(cfg).config)
    schedule = cfg.schedule_for(world_size)
    factor, micro = schedule.factor_at(0), cfg.data.micro_batch_size  # the back end follows every later change
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=factor,
              train_batch_size=micro * factor * world_size)
    if cfg.optimizer.max_grad_norm is not None or not ds.get("gradient_clipping"):
        ds["gradient_clipping"] = 0.0  # the engine clips (optimizer.max_grad_norm), or nobody does
    ds.setdefault("steps_per_print", 2**31 - 1)  # progress and metrics.jsonl report steps; keep DeepSpeed quiet
    # DeepSpeed's throughput timer is on by default and synchronises the device at every forward and every ds.step()
    # (twice per micro-batch here); metrics.jsonl times steps already. Left on only when the user's JSON asks.
    ds.setdefault("timers", {"throughput": {"enabled": False}})
    if client_optimizer and ds.get("zero_optimization", {}).get("stage", 0):
        # torch SGD: exact under ZeRO (tests/accum_sched/test_deepspeed.py)
        ds.setdefault("zero_allow_untested_optimizer", True)
    return ds


def _prepare_environment(world_size: int) -> None:
    """What DeepSpeed needs before its import / init: the accelerator, a stable JIT cache, a process group."""
    import torch  # the worker's: config validation imports this module on login nodes without torch

    from accum_sched.backends.deepspeed import ensure_torch_extensions_dir  # imports torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skip DeepSpeed's accelerator probing and its warning
    ensure_torch_extensions_dir()
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists; torchrun and the deepspeed launcher set it
    if world_size == 1:  # a lone `python -m launcher.worker`: DeepSpeed wants a process group of one
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")


def _device_args() -> dict:
    """DeepSpeed takes cuda:LOCAL_RANK unless told otherwise; under srun's per-task GPU binding the worker's device
    (launcher/launch/env.py: cuda_index, already set by the worker) is cuda:0 on every rank."""
    import torch  # the worker's: config validation imports this module on login nodes without torch

    if not torch.cuda.is_available():
        return {}
    return {"args": argparse.Namespace(device_rank=torch.cuda.current_device())}


def initialize(cfg, model, optimizer, lr_scheduler, world_size: int):
    """Build the DeepSpeed engine on this worker: ``(ds_engine, optimizer, lr_scheduler)`` as DeepSpeed holds them.

    The YAML's optimizer and LR scheduler are handed to DeepSpeed unless its JSON has its own sections.
    """
    validate(cfg, world_size)
    _prepare_environment(world_size)
    from accum_sched.backends.deepspeed import import_deepspeed  # worker only: it imports torch

    deepspeed = import_deepspeed()
    import torch.distributed as dist  # the worker's: config validation imports this module without torch
    from deepspeed.utils import logger as ds_logger  # optional, worker only

    # DeepSpeed logs its whole config at INFO, and warns that torch SGD is an "untested" ZeRO optimizer (it is exact:
    # tests/accum_sched/test_deepspeed.py); our progress line is the UI. Its later warnings still show.
    ds_logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    ds = parse(cfg).config
    own_optimizer, own_scheduler = "optimizer" in ds, "scheduler" in ds
    config = deepspeed_config(cfg, world_size, client_optimizer=not own_optimizer)
    kwargs = {"model_parameters": [p for p in model.parameters() if p.requires_grad]} if own_optimizer else {
        "optimizer": optimizer}
    if not own_scheduler and not own_optimizer and lr_scheduler is not None:
        kwargs["lr_scheduler"] = lr_scheduler  # DeepSpeed steps it once per optimizer step
    quiet = dist.is_initialized() and dist.get_rank() != 0
    # other ranks stay quiet: DeepSpeed prints a line per rank when it loads its shared-memory op
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        ds_engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(model=model, config=config, **kwargs,
                                                                        **_device_args())
    ds_logger.setLevel(logging.WARNING)
    return ds_engine, ds_optimizer, ds_scheduler


def consolidated_state_dict(ds_engine) -> dict | None:
    """The final model as a plain fp32 state_dict on rank 0 (None elsewhere), at every ZeRO stage. Collective."""
    from accum_sched.backends.deepspeed import consolidated_state_dict as gather  # imports torch: worker only

    return gather(ds_engine, rank0_only=True)


# -- the launcher's back end ------------------------------------------------------------------------------------
class DeepSpeedBackend(LauncherBackend):
    """DeepSpeed ZeRO 0-3: the engine built by deepspeed.initialize steps the optimizer and LR scheduler; its
    checkpoints are DeepSpeed's per-rank files under ``deepspeed/``."""

    name = "deepspeed"
    sharded_checkpoint = True
    # DeepSpeed reads its files with torch.load(weights_only=False): the Checkpointer checks their pickles first
    unpickled_files = TAG
    options = OPTIONS

    def validate(self, cfg) -> None:
        if cfg.distributed.deepspeed_config is None:
            raise ConfigError(FIELD, "is required with backend: deepspeed",
                              "give the path of a DeepSpeed JSON file or an inline mapping")
        if cfg.run.compile is not False:  # the engine owns the module and its ZeRO hooks; not measured compiled
            raise ConfigError("run.compile", "is not supported with distributed.backend: deepspeed (its engine "
                              "wraps the module and drives the ZeRO partition hooks itself)",
                              "set run.compile: false, or use distributed.backend: ddp or fsdp")
        if cfg.checkpoint.async_:  # engine.save_checkpoint is collective and writes while the ranks wait in it
            raise ConfigError("checkpoint.async", "is not supported with distributed.backend: deepspeed (its "
                              "engine.save_checkpoint writes its own shards synchronously, a collective on the "
                              "training ranks)", "set checkpoint.async: false, or use distributed.backend: ddp or fsdp")
        acc = cfg.accumulation  # the key that asks for the noise scale, named in the error
        field = "accumulation.noise_scale" if acc.noise_scale else "accumulation.adaptive" if acc.adaptive else None
        if field is not None:
            _check_measuring(cfg, field, acc.adaptive is not None)

    def resolve_raw(self, cfg) -> dict | None:
        return resolved_raw(cfg)

    def preflight(self, cfg) -> None:
        validate(cfg, cfg.world_size)  # the module's JSON checks, with the launch's world size

    def check_world_change(self, what: str, old_world: int) -> None:
        raise ConfigError("checkpoint.on_world_change", f"{what}, and DeepSpeed checkpoints hold per-rank shards",
                          f"resume a DeepSpeed run with {old_world} workers")

    def setup(self, cfg, model, make_optimizer: OptimizerFactory, device, world: int) -> Setup:
        optimizer, lr_scheduler = make_optimizer(model)  # replaced by the JSON's own sections, if it has them
        ds_engine, optimizer, lr_scheduler = initialize(cfg, model, optimizer, lr_scheduler, world)
        from accum_sched.backends.deepspeed import DeepSpeedBackend as LibraryDeepSpeed  # torch: workers only

        return Setup(module=ds_engine, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                     engine_args={"backend": LibraryDeepSpeed(ds_engine, precision=cfg.run.precision)})

    def final_state_dict(self, setup: Setup, rank: int) -> dict | None:
        return consolidated_state_dict(setup.module)

    def save_shards(self, setup: Setup, directory: str) -> None:
        setup.module.save_checkpoint(directory, tag=TAG, save_latest=False)

    def load_shards(self, setup: Setup, directory: str) -> None:
        # the engine restores module, (ZeRO-sharded) optimizer and LR scheduler from its files, under its own rules
        loaded, _ = setup.module.load_checkpoint(directory, tag=TAG, load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
        if loaded is None:
            raise CheckpointError(f"{os.path.join(directory, TAG)}: DeepSpeed could not load it")


def _check_measuring(cfg, field: str, adaptive: bool) -> None:
    """The noise scale is measured at ZeRO stage 0 in fp32 only (elsewhere the local gradient is reduced or
    partitioned inside DeepSpeed); the adaptive factor is not offered (the JSON's own batch keys would fight it)."""
    if adaptive:
        raise ConfigError("accumulation.adaptive", "is not supported with distributed.backend: deepspeed yet",
                          "use backend: ddp, or noise_scale: true with a schedule")
    ds = load_json(cfg)
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    precise = [k for k in ("bf16", "bfloat16", "fp16") if isinstance(ds.get(k), dict) and ds[k].get("enabled")]
    if stage != 0 or precise:
        raise ConfigError(field, f"is measured with DeepSpeed at ZeRO stage 0 in fp32 only (this JSON: stage {stage}"
                          f"{', ' + ', '.join(precise) if precise else ''}): elsewhere the local gradient is reduced "
                          f"or partitioned inside DeepSpeed", "use zero_optimization.stage 0 without bf16/fp16, or "
                          "backend: ddp")
