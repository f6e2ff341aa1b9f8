"""accum_sched: scheduled gradient accumulation for distributed PyTorch, exact and in lockstep.

``AccumulationSchedule`` says which factor applies where; ``AccumulationEngine`` applies it to a plain module, a
DistributedDataParallel module, an FSDP2 (``fully_shard``) module or a DeepSpeed engine. Importing this package never
imports torch, DeepSpeed or FSDP2.
"""
from accum_sched.schedule import AccumulationSchedule, Position

__version__ = "0.1.0"
__all__ = ["AccumulationSchedule", "AccumulationEngine", "Position", "ResumeSampler", "StepInfo", "optimizer_steps",
           "consolidated_state_dict", "ensure_torch_extensions_dir", "InvariantBatchSampler", "InvariantCollate",
           "wrap_ddp"]


def __getattr__(name):
    # The engine needs torch; the schedule does not. Keep `import accum_sched` torch-free until the engine is used.
    if name in ("AccumulationEngine", "StepInfo", "optimizer_steps"):
        from accum_sched import engine

        return getattr(engine, name)
    if name == "ResumeSampler":
        from accum_sched.resume import ResumeSampler

        return ResumeSampler
    if name in ("InvariantBatchSampler", "InvariantCollate"):
        from accum_sched import invariant

        return getattr(invariant, name)
    if name == "wrap_ddp":
        from accum_sched.backends.ddp_carrier import wrap_ddp

        return wrap_ddp
    if name in ("consolidated_state_dict", "ensure_torch_extensions_dir"):
        # the DeepSpeed back end's helpers; that module imports DeepSpeed only inside the functions that need it
        from accum_sched.backends import deepspeed

        return getattr(deepspeed, name)
    raise AttributeError(f"module 'accum_sched' has no attribute {name!r}")
