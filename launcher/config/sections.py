"""The config's sections as typed, frozen pydantic dataclasses: every key with its type, default, check, doc and mark.

The sections are the schema. Each key is declared with :func:`launcher.options.key`, whose metadata holds what
validation needs (choices, check, hint, the typed options of a mapping-valued key), the line of the reference in
docs/cli.md (``doc``, printed by ``python -m launcher.config.reference``) and ``train``: whether the key changes what
is trained. The checkpoint's config hash (launcher/checkpoint/store.py: training_config) covers exactly the keys
marked ``train=True``, so every new key has to say (the argument is required) whether a checkpoint made under another
value may be resumed. The hash leaves out keys at their default, so a key added with its default keeps older
checkpoints resumable; the other side of that: changing the default of a hashed key changes what older checkpoints
recorded by leaving it out.

The type of a key is its annotation: ``int``, ``float``, ``str``, ``bool``, ``dict`` (a mapping), ``list``, a union
of several, a nested section (``FSDPConfig``); ``| None`` allows null. :func:`launcher.options.section` makes each
annotation the strict pydantic type that validates it; a back end's keys (``distributed.fsdp``,
``distributed.deepspeed_config``) are declared in its own module and added to DistributedConfig from the registry.
Rules between keys live in schema.py; torch-free, like all of launcher/config.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar, Literal

import pydantic

from accum_sched import co_scale, schedule_from
from accum_sched.schedule import UNITS, AccumulationSchedule
from launcher import backends
from launcher.config.noise import AdaptiveOptions
from launcher.config.trackers import MLflowOptions, WandbOptions
from launcher.errors import ConfigError
from launcher.import_path import looks_like_path
from launcher.options import MODEL_CONFIG, Section, at_least, key, options, positive, section

__all__ = ["Config", "Section", "at_least", "key", "positive", "section"]


def name_or_path(known):
    def check(value):
        if value in known or looks_like_path(value):
            return None
        return f"{value!r} is not one of {', '.join(known)} nor an import path"
    return check


# -- the typed options of mapping-valued keys: the value stays the mapping as written (config.yaml, the hash) --
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@options
class CompileOptions:
    """``run.compile`` as a mapping: torch.compile's keywords."""

    mode: Literal[COMPILE_MODES] | None = None
    dynamic: bool | None = None  # null lets torch.compile decide (it marks a size dynamic when it changes)
    fullgraph: bool = False


@options
class EarlyStop:
    """``eval.early_stop``: stop after ``patience`` evaluations without an improvement of at least ``min_delta``."""

    patience: Annotated[int, pydantic.Field(ge=1)]
    min_delta: Annotated[float, pydantic.Field(ge=0)] = 0.0


@options
class CoScaleRules:
    """``accumulation.co_scale``: the rules of accum_sched.co_scale (its KEYS name each key's choices)."""

    lr: Literal[co_scale.KEYS["lr"]] = "none"
    beta2: Literal[co_scale.KEYS["beta2"]] = "none"
    weight_decay: Literal[co_scale.KEYS["weight_decay"]] = "none"


@options
class ScheduleFromSpec:
    """``accumulation.schedule_from``: accum_sched.schedule_from's rule and cap."""

    rule: Literal[schedule_from.RULES]
    max_factor: Annotated[int, pydantic.Field(ge=1)] = 8


OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULERS = ("constant", "linear", "cosine", "onecycle")


# -- the sections -----------------------------------------------------------------------------------------------
@section
class RunConfig(Section):
    SECTION: ClassVar[str] = "run"
    output_dir: str = key("runs/run", train=False, doc="the run directory")
    seed: int = key(0, train=True, doc="seeds python, numpy and torch (identical initial weights on every rank) "
                                       "and the sampler")
    epochs: int = key(1, train=True, check=at_least(1), doc="epochs to train")
    precision: str = key("fp32", train=True, choices=("fp32", "bf16", "fp16"),
                         doc="`fp32`, `bf16` (autocast) or `fp16` (autocast + GradScaler, CPU or GPU); see "
                             "[Precision](training.md#precision)")
    max_steps: int | None = key(None, train=True, check=at_least(1),
                                doc="end the run after this many optimizer steps (null: after `run.epochs`); what "
                                    "ends a run on an endless stream, see [Streams](data.md)")
    compile: bool | dict = key(False, train=False, model=CompileOptions,
                               doc="`torch.compile` the model: false, true, or `{mode, dynamic, fullgraph}` passed "
                                   "to it (single process, DDP, FSDP2 per block); see "
                                   "[torch.compile](training.md#torchcompile)")


@section
class TaskConfig(Section):
    SECTION: ClassVar[str] = "task"
    target: str = key(train=True, hint="write 'module:function' or 'builtin:regression'",
                      doc="`module:function` or `builtin:regression` / `builtin:charlm` / `builtin:hf_causal_lm` / "
                          "`builtin:stream_lm`")
    args: dict = key({}, train=True, doc="keyword arguments of the task function")


@section
class DataConfig(Section):
    SECTION: ClassVar[str] = "data"
    micro_batch_size: int = key(train=True, check=at_least(1), doc="samples per micro-batch per rank")
    shuffle: bool = key(True, train=True, doc="DistributedSampler shuffling (re-seeded every epoch with `set_epoch`)")
    drop_last: bool = key(False, train=True, doc="drop each rank's short last micro-batch (the sampler always pads "
                                                 "ranks to equal length)")
    num_workers: int = key(0, train=False, check=at_least(0), doc="DataLoader workers")
    sampler: str = key("distributed", train=True, choices=("distributed", "invariant"),
                       doc="`distributed`: DistributedSampler's order (each rank its own share); `invariant`: each "
                           "window the next global batch of the epoch's order, split over the ranks, so which "
                           "samples a step sees does not depend on the world size; see [Invariant "
                           "windows](data.md#world-invariant-windows)")
    shard: str = key("auto", train=True, choices=("auto", "none"),
                     doc="a task's `IterableDataset`: `auto` splits it by rank and loader worker, `none`: the task "
                         "shards it itself; see [Streams](data.md)")


@section
class AccumulationConfig(Section):
    SECTION: ClassVar[str] = "accumulation"
    schedule: dict[int, int] | str | int | None = key(
        None, train=True, kind="schedule", hint="write e.g. {0: 1, 5: 2, 10: 4}",
        doc="factor per epoch (or `unit`), e.g. `{0: 1, 4: 2}`; null: factor 1 or `global_batch`'s; see "
            "[Schedules](guide.md#schedules)")
    global_batch: int | None = key(None, train=True, check=at_least(1),
                                   doc="fixed global batch instead of a schedule (the factor follows the world size)")
    lr_coupling: str = key("none", train=True, choices=("none", "linear", "sqrt", "adascale"),
                           doc="`none`, `linear`, `sqrt`, `adascale` (needs the noise scale; see "
                               "[adaptive](adaptive.md))")
    schedule_from: dict | None = key(None, train=True, model=ScheduleFromSpec,
                                     doc="`{rule: smith|seesaw, max_factor}`: the factor grows where the LR scheduler "
                                         "would decay, instead of `schedule` ([batch size](batch-size.md))")
    co_scale: dict | None = key(None, train=True, model=CoScaleRules,
                                doc="`{lr: none|linear|sqrt|auto, beta2: none|half_life, weight_decay: none|tau}`: "
                                    "the optimizer follows the effective batch ([batch size](batch-size.md))")
    unit: str = key("epoch", train=True, choices=UNITS, doc="what the schedule is keyed by: `epoch`, `step`, "
                                                            "`samples`, `tokens`")
    normalize: str = key("elements", train=True, choices=("elements", "micro_batches"),
                         doc="`elements` (exact) or `micro_batches` (Lightning's rule)")
    uneven: str = key("truncate", train=True, choices=("truncate", "error"),
                      doc="ranks with loaders of different length: `truncate` or `error`")
    nonfinite: str = key("skip", train=True, choices=("skip", "raise"),
                         doc="a non-finite gradient: `skip` the step or `raise`")
    # the gradient noise scale of every window, and a factor that follows it (launcher/config/noise.py)
    noise_scale: bool = key(False, train=True, doc="measure the gradient noise scale of every step into "
                                                   "metrics.jsonl ([adaptive](adaptive.md))")
    adaptive: dict | None = key(None, train=True, model=AdaptiveOptions,
                                doc="`{min_factor, max_factor, every_n_steps, ema, hysteresis}`: the factor follows "
                                    "the noise scale instead of a schedule ([adaptive](adaptive.md))")


@section
class OptimizerConfig(Section):
    SECTION: ClassVar[str] = "optimizer"
    name: str = key("adamw", train=True, check=name_or_path(OPTIMIZERS),
                    hint="use sgd, adam, adamw or an import path such as torch.optim.RMSprop or mypkg.optim:Lion",
                    doc="`sgd`, `adam`, `adamw` (torch's defaults for anything not given; SGD momentum 0) or an "
                        "import path, see [Optimizers](training.md#optimizers-and-lr-schedulers-by-import-path)")
    args: dict = key({}, train=True, doc="extra keyword arguments of the optimizer's constructor")
    no_decay: list[str] = key([], train=True, doc="parameter name parts without weight decay, e.g. `[bias, norm]`")
    lr: float = key(1e-3, train=True, check=positive, doc="learning rate")
    weight_decay: float | None = key(None, train=True, check=at_least(0), doc="weight decay; null: torch's default")
    momentum: float | None = key(None, train=True, check=at_least(0), doc="SGD only; null: torch's default")
    betas: list[float] | None = key(None, train=True, doc="Adam/AdamW only, e.g. `[0.9, 0.999]`; null: torch's default")
    eps: float | None = key(None, train=True, check=positive, doc="Adam's epsilon; null: torch's default")
    max_grad_norm: float | None = key(None, train=True, check=positive,
                                      doc="clip the global gradient norm on every step")


@section
class LRSchedulerConfig(Section):
    SECTION: ClassVar[str] = "lr_scheduler"
    name: str = key("constant", train=True, check=name_or_path(LR_SCHEDULERS),
                    hint="use constant, linear, cosine, onecycle or an import path such as "
                         "torch.optim.lr_scheduler.StepLR",
                    doc="`constant`, `linear`, `cosine`, `onecycle` (totals from the schedule-aware step count) or "
                        "the import path of a scheduler class")
    args: dict = key({}, train=True, doc="keyword arguments of a scheduler given by import path")
    warmup_steps: int = key(0, train=True, check=at_least(0), doc="linear warm-up steps of the built-in schedulers")
    min_lr: float = key(0.0, train=True, check=at_least(0), doc="the LR the built-in schedulers decay to")


# Validation (launcher/train/evaluate.py): after every n epochs and/or every n optimizer steps, when the task returns a
# val_dataset. monitor/mode choose model-best.pt; early_stop is null or {patience, min_delta}.
@section
class EvalConfig(Section):
    SECTION: ClassVar[str] = "eval"
    every_n_epochs: int | None = key(1, train=False, check=at_least(1),
                                     doc="validate after every N-th epoch (null: never at epoch ends); see "
                                         "[Validation](training.md#validation)")
    every_n_steps: int | None = key(None, train=False, check=at_least(1),
                                    doc="also validate after every N optimizer steps (mid-epoch)")
    micro_batch_size: int | None = key(None, train=False, check=at_least(1),
                                       doc="batch size of the evaluation; null: `data.micro_batch_size`")
    monitor: str = key("val_loss", train=False, doc="what model-best.pt and early stopping look at: `val_loss` or "
                                                    "a `metrics_fn` name")
    mode: str = key("min", train=False, choices=("min", "max"), doc="`min` or `max` of `eval.monitor` is best")
    early_stop: dict | None = key(None, train=False, model=EarlyStop, doc="null, or `{patience: 3, min_delta: 0.0}`")


def _with_backend_options(cls):
    """``cls`` with every back end's option keys added (``distributed.deepspeed_config``, ``distributed.fsdp``):
    a back end declares its keys in its own module, and the registry is the one list of them."""
    for name, (annotation, declared) in backends.options().items():
        cls.__annotations__[name] = annotation
        setattr(cls, name, declared)
    return cls


def node_range(value: int | str) -> tuple[int, int]:
    """``(min, max)`` nodes of distributed.nnodes: ``4`` is (4, 4), ``"1:4"`` is (1, 4). ValueError when malformed."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value, value
    low, sep, high = str(value).partition(":")
    if not sep:
        return int(low), int(low)
    return int(low), int(high)


def nodes_problem(value) -> str | None:
    try:
        low, high = node_range(value)
        if isinstance(value, str) and ":" not in value:
            raise ValueError(value)
    except ValueError:
        return f'{value!r} is neither a number of nodes nor "MIN:MAX"'
    if low < 1 or high < low:
        return f"{value!r} needs 1 <= MIN <= MAX, got {low} and {high}"
    return None


@section
@_with_backend_options
class DistributedConfig(Section):
    SECTION: ClassVar[str] = "distributed"
    backend: str = key("ddp", train=True, choices=backends.names(), doc="`ddp`, `deepspeed` or `fsdp`")
    # the world size is not hashed: resuming on another one has its own policy, checkpoint.on_world_change
    nproc_per_node: int = key(1, train=False, check=at_least(1), doc="workers per node")
    # an int, or "MIN:MAX" (quoted: YAML reads an unquoted 1:3 as the base-60 int 63) for an elastic run
    nnodes: int | str = key(1, train=False, check=nodes_problem,
                            hint='a number of nodes, or "MIN:MAX" (quoted) for an elastic run, e.g. "1:4"',
                            doc='nodes, or `"MIN:MAX"` (quoted) for an elastic run; see [Elastic runs](elastic.md)')
    process_group: str = key("auto", train=False, choices=("auto", "gloo", "nccl"),
                             doc="`auto` (nccl with CUDA, else gloo), `gloo`, `nccl`")
    find_unused_parameters: bool = key(False, train=False, doc="passed to DDP")
    timeout_s: int = key(600, train=False, check=at_least(10), doc="process-group timeout")
    max_restarts: int = key(0, train=False, check=at_least(0), doc="torchrun restarts of a failed worker group")
    stop_poll_every: int = key(1, train=False, check=at_least(1),
                               doc="the workers agree on a stop (preemption, Ctrl-C) every N micro-batches: a stop "
                                   "lands within 2N micro-batches, at 1/N of the one-number all-reduces")
    stop_poll_min_ms: float = key(100.0, train=False, check=at_least(0),
                                  doc="and no more often than once per this many milliseconds of training (measured "
                                      "each window): micro-batches faster than that are polled every few, a stop "
                                      "lands within about 2x this; 0: every N micro-batches whatever their time")

    @property
    def node_range(self) -> tuple[int, int]:
        return node_range(self.nnodes)

    @property
    def elastic(self) -> bool:
        """nnodes written as "MIN:MAX": torchrun's elastic agent, whose group may re-form with another size."""
        return isinstance(self.nnodes, str)
    # then each back end's own options (launcher/backends/<name>.py: OPTIONS), in the registry's order


@section
class CheckpointConfig(Section):
    SECTION: ClassVar[str] = "checkpoint"
    every_n_steps: int | None = key(None, train=False, check=at_least(1),
                                    doc="also checkpoint every N optimizer steps (always at epoch ends); see "
                                        "[Checkpoints](checkpoints.md)")
    keep_last: int = key(2, train=False, check=at_least(1), doc="checkpoints kept")
    dir: str | None = key(None, train=False, doc="null: `<run.output_dir>/checkpoints`")
    # resume a checkpoint made under different training fields (see launcher/checkpoint/store.py)
    force_resume: bool = key(False, train=False, doc="resume a checkpoint made under other training fields (the "
                                                     "differences are printed as warnings)")
    # resuming on another world size: error | keep_global_batch | keep_factor (notes/checkpoint.md)
    on_world_change: str = key("error", train=False, choices=("error", "keep_global_batch", "keep_factor"),
                               doc="resuming on another number of workers: `error`, `keep_global_batch` or "
                                   "`keep_factor`")
    # how long ranks wait while rank 0 writes, hashes or verifies a checkpoint (launcher/checkpoint/coordination.py)
    timeout_s: int = key(3600, train=False, check=at_least(10),
                         doc="how long ranks wait while rank 0 writes, hashes or verifies a checkpoint")
    # `async` is a Python keyword: the attribute is async_ (launcher/checkpoint/background.py writes beside training)
    async_: bool = key(False, train=False, name="async",
                       doc="write checkpoints beside training: the step pays only the copy to host memory; not "
                           "with DeepSpeed; see [Checkpoints](checkpoints.md#asynchronous-checkpoints)")


@section
class LoggingConfig(Section):
    SECTION: ClassVar[str] = "logging"
    progress: str = key("auto", train=False, choices=("auto", "bar", "plain", "none"),
                        doc="`auto` (bar on a TTY, plain lines otherwise), `bar`, `plain`, `none`")
    tensorboard: str = key("auto", train=False, choices=("auto", "on", "off"),
                           doc="event files in `output_dir/tensorboard` when TensorBoard is installed")
    log_every: int = key(10, train=False, check=at_least(1), doc="plain progress line every N steps")
    # experiment trackers on rank 0 (launcher/config/trackers.py checks the keys; launcher/train/trackers.py logs)
    wandb: dict | None = key(None, train=False, model=WandbOptions,
                             doc="null, or `{project, name, tags, mode: online|offline|disabled, entity, dir}`: log "
                                 "config, metrics and summary to Weights & Biases; see [Trackers](trackers.md)")
    mlflow: dict | None = key(None, train=False, model=MLflowOptions,
                              doc="null, or `{experiment, run_name, tags, tracking_uri}` (default a file store in "
                                  "`output_dir/mlruns`): log to MLflow; see [Trackers](trackers.md)")


# `accum-sched slurm` only (launcher/launch/slurm.py checks the formats); nodes and workers per node come
# from distributed.nnodes / distributed.nproc_per_node.
@section
class SlurmConfig(Section):
    SECTION: ClassVar[str] = "slurm"
    template: str = key("torchrun", train=False, hint="torchrun, per_task or the path of a .sbatch template",
                        doc="`torchrun`, `per_task` or the path of an sbatch template; see [SLURM](slurm.md)")
    gpus_per_node: int = key(0, train=False, check=at_least(0), doc="GPUs per node (one worker each)")
    cpus_per_worker: int = key(1, train=False, check=at_least(1), doc="CPUs per worker")
    partition: str | None = key(None, train=False, doc="sbatch `--partition`")
    account: str | None = key(None, train=False, doc="sbatch `--account`")
    # a string: YAML reads an unquoted 1:30:00 as the int 5400
    time: str | int | None = key(None, train=False, doc="sbatch `--time`, quoted (`\"1-00:00:00\"`)")
    job_name: str | None = key(None, train=False, doc="null: `accum-<run directory name>`")
    signal: str = key("USR2@90", train=False, doc="the preemption warning (sbatch `--signal`)")
    requeue: bool = key(True, train=False, doc="requeue the job after a preemption")
    extra_sbatch: list[str] = key([], train=False, doc="more sbatch options, e.g. `[--qos=high]`")
    setup: list[str] = key([], train=False, doc="shell lines run before the workers start")


# -- the whole config -------------------------------------------------------------------------------------------
@pydantic.dataclasses.dataclass(frozen=True, eq=False, config=MODEL_CONFIG)
class Config:
    """A validated configuration. ``cfg.section.key``; ``cfg.lr_scheduler`` is None when written as null.

    The fields are the sections in the order config.yaml lists them; a section typed ``X | None`` may be written as
    null as a whole (``lr_scheduler: null`` for a constant LR), a section with a required key must be written."""

    run: RunConfig
    task: TaskConfig
    data: DataConfig
    accumulation: AccumulationConfig
    optimizer: OptimizerConfig
    lr_scheduler: LRSchedulerConfig | None
    eval: EvalConfig
    distributed: DistributedConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    slurm: SlurmConfig

    def __getattr__(self, name):  # only reached for names that are not sections
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"config has no section {name!r}")

    def to_dict(self) -> dict:
        return {f.name: (None if v is None else v.to_dict()) for f, v in ((f, getattr(self, f.name))
                                                                         for f in dataclasses.fields(self))}

    @property
    def schedule(self) -> AccumulationSchedule:
        return self.schedule_for(self.world_size)

    def schedule_for(self, world_size: int) -> AccumulationSchedule:
        """The schedule at ``world_size`` ranks: as written, or the constant factor of ``global_batch``."""
        acc = self.accumulation
        if acc.global_batch is None:
            return AccumulationSchedule(1 if acc.schedule is None else acc.schedule, acc.unit)
        per_factor = self.data.micro_batch_size * world_size
        if acc.global_batch % per_factor:
            raise ConfigError("accumulation.global_batch",
                              f"{acc.global_batch} is not a multiple of micro_batch_size x world = "
                              f"{self.data.micro_batch_size} x {world_size} = {per_factor}",
                              "choose a global batch that micro x world divides, or change the micro-batch")
        return AccumulationSchedule(acc.global_batch // per_factor, acc.unit)

    @property
    def world_size(self) -> int:
        """Workers of a launch: an elastic run's largest group (its checks before launch need the most ranks; a
        worker knows its real world from the process group)."""
        return self.distributed.nproc_per_node * self.distributed.node_range[1]
