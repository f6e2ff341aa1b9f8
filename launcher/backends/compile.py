"""``run.compile``: torch.compile for the single-process, DDP and FSDP2 back ends, and its summary.json counters.

Modules are compiled in place: the module keeps its class, its parameters and its state_dict keys (no
``_orig_mod.`` prefix as ``torch.compile(module)`` would add), so checkpoints, model.pt and resume are the same
for a compiled and an eager run. What is compiled is the module's ``forward``; ``__call__`` with its hooks stays
eager, so the DDP reducer and FSDP2's all-gather / reshard hooks run as they do without compile.

Why not ``nn.Module.compile()``: it compiles ``Module._call_impl``, and with torch 2.13 Dynamo skips that frame and
every ``forward`` defined inside torch (measured: ``nn.Sequential(...).compile()`` and
``nn.TransformerEncoderLayer(...).compile()`` capture no graph at all). A frame of our own around the bound
``forward`` (what torch's OptimizedModule does for torch.nn modules) gives Dynamo a frame it traces, and it inlines
the module's forward from there.

Counters (torch 2.13 keeps no public total of recompilations): ``compile_graphs`` is Dynamo's
``counters["stats"]["unique_graphs"]`` (every FX graph captured, a graph break's pieces and recompilations
included); ``compile_recompiles`` counts Dynamo's compilation records with a ``recompile_reason``, i.e. a frame
compiled again because a guard of its earlier graphs failed (a new batch shape, grad mode, train/eval).

torch is imported inside the functions: the config side imports nothing from here.
"""
from __future__ import annotations

from collections.abc import Iterable

_METRICS_LIMIT = 1_000_000  # Dynamo keeps its last 64 compilation records by default: keep every one of this run


def options(value) -> dict | None:
    """``run.compile`` as keyword arguments of torch.compile: None when false, {} for true, else the mapping's keys
    (mode, dynamic, fullgraph; validated in launcher/config/schema.py)."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    return dict(value)


def compile_module(module, opts: dict) -> None:
    """Compile ``module``'s forward in place with torch.compile(**opts); hooks, class and state_dict unchanged."""
    # torch on the worker only: config validation imports this module on login nodes
    import torch
    import torch._dynamo.utils as dynamo_utils  # torch: workers only (config validation imports this module)

    dynamo_utils.set_compilation_metrics_limit(_METRICS_LIMIT)
    forward = module.forward  # the bound method (the class's forward): Dynamo inlines it from the frame below

    def compiled_forward(*args, **kwargs):
        return forward(*args, **kwargs)

    # every module its own recompile region: the frame's code is shared by all compiled modules, and without it
    # block 2's first compile would count as block 1's recompilation (and 8 blocks would reach recompile_limit)
    module.forward = torch.compile(compiled_forward, isolate_recompiles=True, **opts)
    module._accum_sched_compiled = True


def compile_modules(modules: Iterable, opts: dict | None) -> int:
    """Compile each of ``modules`` in place (nothing when ``opts`` is None); returns how many were compiled."""
    if opts is None:
        return 0
    count = 0
    for module in modules:
        compile_module(module, opts)
        count += 1
    return count


def is_compiled(module) -> bool:
    """Whether :func:`compile_module` compiled ``module`` or one of its submodules."""
    return any(getattr(m, "_accum_sched_compiled", False) for m in module.modules())


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: Dynamo's compilation records (forward frames, and the
    backward graphs AOTAutograd compiles lazily at the first backward) with their durations."""
    import torch._dynamo.utils as dynamo_utils  # torch: workers only (config validation imports this module)

    return sum((m.duration_us or 0) for m in dynamo_utils.get_compilation_metrics()) / 1e6


class CompileClock:
    """Rank 0's lines about ``run.compile``: one before the first step (the first forward and backward compile,
    which took 65 s on CPU with nothing printed), then one after each step during which compilation ran, with how
    long it took. ``seconds`` is the running total, which the ETA's pace leaves out."""

    def __init__(self, model, say=print):
        self.active, self.say, self.seconds = is_compiled(model), say, 0.0
        if self.active:
            self.say("accum-sched: run.compile: the first step compiles the model's forward and backward "
                     "(torch.compile; nothing is printed until it is done)", flush=True)

    def after_step(self, step: int) -> float:
        if not self.active:
            return 0.0
        total = compile_seconds()
        if total - self.seconds >= 0.05:  # a compilation ran during this step (a first one, or a new shape's)
            first = self.seconds == 0.0
            self.say(f"accum-sched: run.compile: {'compiled' if first else 'recompiled'} in "
                     f"{total - self.seconds:.1f}s (step {step}; {total:.1f}s in all)", flush=True)
            self.seconds = total
        return self.seconds


def compile_stats(model) -> dict:
    """summary.json's ``compile_graphs`` and ``compile_recompiles``: Dynamo's totals in this process so far, both
    None when nothing of ``model`` was compiled."""
    if not is_compiled(model):
        return {"compile_graphs": None, "compile_recompiles": None}
    # torch on the worker only: config validation imports this module on login nodes
    import torch._dynamo.utils as dynamo_utils  # torch: workers only (config validation imports this module)

    graphs = int(dynamo_utils.counters["stats"]["unique_graphs"])
    recompiles = sum(1 for m in dynamo_utils.get_compilation_metrics()
                     if m.recompile_reason is not None and m.is_forward is not False)
    return {"compile_graphs": graphs, "compile_recompiles": recompiles}
