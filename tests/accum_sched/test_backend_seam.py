"""The back-end seam (accum_sched/backends/, docs/backends.md): interface, registry, imports.

* every registered back end implements :class:`Backend` and declares :class:`Capabilities`;
* the registry picks the one-process, DDP and FSDP2 back ends for the right models (a real 1-rank gloo group) and
  refuses what it refused before, with the same messages;
* a back end written against the interface alone (a new class, one registry entry) trains bit for bit like the
  built-in one-process back end: the interface is all the engine needs;
* no import cycle inside accum_sched (AST, function-level imports included);
* importing accum_sched and building a one-process or DDP back end imports neither DeepSpeed nor the FSDP2 or
  DeepSpeed back-end modules.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import paths
from distributed import attempt, spawn

ROOT = paths.ROOT_PATH
PACKAGE = ROOT / "accum_sched"


# -- (a) the interface --------------------------------------------------------------------------------------------
def test_every_registered_back_end_implements_the_interface():
    from accum_sched.backends import REGISTRY, Backend, Capabilities

    assert [e.name for e in REGISTRY] == ["deepspeed", "fsdp2", "ddp", "single"]
    for entry in REGISTRY:
        cls = entry.load()
        assert issubclass(cls, Backend), entry.name
        assert not inspect.isabstract(cls), f"{entry.name}: {sorted(cls.__abstractmethods__)} left abstract"
        assert isinstance(cls.capabilities, Capabilities), entry.name
        assert cls.name != Backend.name, f"{entry.name} has no name of its own for messages"
        params = inspect.signature(cls.__init__).parameters
        assert list(params)[2:4] == ["optimizer", "lr_scheduler"], (entry.name, list(params))  # (self, model, ...)
        own = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert own and own[0].name == "precision" and own[0].default == "fp32", (entry.name, own)  # then its own
        assert all(p.default is not inspect.Parameter.empty for p in own), (entry.name, own)  # each optional
        if cls.capabilities.stop_mid_window:  # the open-window methods are real, not the base's refusal
            for method in ("local_grads", "local_grad_tensors", "load_local_grads"):
                assert getattr(cls, method) is not getattr(Backend, method), (entry.name, method)
        if cls.capabilities.noise_scale == "buckets":
            assert cls.observe_buckets is not Backend.observe_buckets, entry.name


def test_capabilities_are_checked_and_frozen():
    import dataclasses

    from accum_sched.backends import Capabilities

    caps = Capabilities(stop_mid_window=True, prescale=True, fp16="grad_scaler", noise_scale=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.prescale = False
    with pytest.raises(ValueError, match="fp16"):
        Capabilities(stop_mid_window=True, prescale=True, fp16="yes", noise_scale=None)
    with pytest.raises(ValueError, match="noise_scale"):
        Capabilities(stop_mid_window=True, prescale=True, fp16="native", noise_scale="guess")


# -- (b) the registry, on a real 1-rank gloo group -----------------------------------------------------------------
def _choices(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accum_sched import AccumulationEngine
    from accum_sched.backends import backend_class, make_backend

    def linear():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))

    def chosen(model, **kw):
        backend = make_backend(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
        return {"class": type(backend).__name__, "fp16": backend.capabilities.fp16,
                "scaler": backend.scaler is not None,
                "in_collective": backend.capabilities.stats_in_gradient_collective}

    def noise_engine(model):
        return AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, noise_scale=True)

    class DeepSpeedEngine(torch.nn.Module):  # recognised by its name alone: the predicate imports nothing
        pass

    mesh = init_device_mesh("cpu", (world,))
    report = {
        "plain": chosen(linear()),
        "plain_fp16": chosen(linear(), precision="fp16"),
        "ddp": chosen(DDP(linear())),
        "ddp_uncounted": chosen(DDP(linear()), count_allreduce=False),
        "fsdp2": chosen(fully_shard(linear(), mesh=mesh)),
        "deepspeed_class": backend_class(DeepSpeedEngine()).__name__,
    }
    half = linear()
    fully_shard(half[0], mesh=mesh)  # blocks sharded, the root not
    refusals = {
        "half_sharded": lambda: chosen(half),
        "fsdp_fp16": lambda: chosen(fully_shard(linear(), mesh=mesh), precision="fp16"),
        "ddp_every_micro_batch": lambda: chosen(DDP(linear()), gradient_sync="every_micro_batch"),
        "engine_keep_gathered_on_ddp": lambda: AccumulationEngine(DDP(linear()), torch.optim.SGD(
            linear().parameters(), lr=0.1), keep_gathered=True),
        "fsdp_noise": lambda: noise_engine(fully_shard(linear(), mesh=mesh)),
    }
    for name, make in refusals.items():
        report[name] = attempt(make)["error"]
    with open(os.path.join(out, "choices.json"), "w") as f:
        json.dump(report, f)


@pytest.mark.slow
def test_registry_picks_the_back_end_for_each_model(tmp_path):
    spawn(_choices, 1, str(tmp_path), deadline_s=120)
    report = json.loads((tmp_path / "choices.json").read_text())
    assert report["plain"] == {"class": "SingleProcessBackend", "fp16": "grad_scaler", "scaler": False,
                               "in_collective": False}
    assert report["plain_fp16"]["scaler"] is True
    assert report["ddp"] == {"class": "DDPBackend", "fp16": "grad_scaler", "scaler": False, "in_collective": True}
    assert report["ddp_uncounted"]["in_collective"] is False  # no hook: the numbers take an all-reduce of their own
    assert report["fsdp2"] == {"class": "FSDPBackend", "fp16": "refused", "scaler": False, "in_collective": False}
    assert report["deepspeed_class"] == "DeepSpeedBackend"
    assert report["half_sharded"] == ["ValueError", ("fully_shard was applied to submodules but not to the model "
                                                     "handed to the engine; apply it to the root too "
                                                     "(fully_shard(model)) after its blocks")]
    assert report["fsdp_fp16"][1].startswith("precision='fp16' (GradScaler) is not supported with FSDP2")
    # an option of another back end is one line naming it and the back end chosen (no shared code knows it)
    assert report["ddp_every_micro_batch"] == ["TypeError", ("gradient_sync= is not an option of the DDP back end "
                                                             "(DDPBackend), chosen for this model; it takes "
                                                             "precision, count_allreduce")]
    assert report["engine_keep_gathered_on_ddp"] == ["TypeError", ("keep_gathered= is not an option of the DDP back "
                                                                   "end (DDPBackend), chosen for this model; it "
                                                                   "takes precision, count_allreduce")]
    assert report["fsdp_noise"] == ["ValueError", ("noise_scale / adaptive are not measured with FSDP2 yet; use DDP "
                                                   "or DeepSpeed ZeRO-0")]


# -- a back end from the interface alone --------------------------------------------------------------------------
def _train(model) -> list:
    from accum_sched import AccumulationEngine

    engine = AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), {0: 2, 1: 3},
                                max_grad_norm=0.5, micro_batch_size=4)
    g = torch.Generator().manual_seed(1)
    for epoch in range(2):
        batches = [(torch.randn(4 if i < 6 else 3, 5, generator=g), torch.randn(4 if i < 6 else 3, 1, generator=g))
                   for i in range(7)]
        engine.train_epoch(batches, lambda m, b: (((m(b[0]) - b[1]) ** 2).sum(), b[0].shape[0]), epoch)
    return [engine.backend.name] + [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def test_a_back_end_written_against_the_interface_trains_like_the_built_in_one():
    """Adding a back end = one new file (tests/minimal_backend.py) + one registry line; nothing else changes."""
    import minimal_backend
    from accum_sched.backends import registry

    def model(cls):
        torch.manual_seed(0)
        return cls(5, 1)

    expected = _train(model(torch.nn.Linear))
    entry = registry.Entry("minimal", minimal_backend.claims, "minimal_backend:MinimalBackend")
    registry.REGISTRY.insert(0, entry)
    try:
        got = _train(model(minimal_backend.Marked))
    finally:
        registry.REGISTRY.remove(entry)
    assert expected[0] == "one process" and got[0] == "minimal"
    assert got[1:] == expected[1:]  # bit for bit


# -- (c) no import cycle ------------------------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Edges module -> accum_sched module it imports, anywhere in its body (function-level imports too)."""
    modules = {_module_name(p): p for p in package.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                raise AssertionError(f"{path}: a relative import (the package imports absolutely)")
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_no_import_cycle_inside_accum_sched():
    graph = import_graph(PACKAGE)
    assert "accum_sched.backends.registry" in graph and graph["accum_sched.engine"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the checker finds one


# -- (d) what importing and choosing a back end imports -----------------------------------------------------------
PROBE = """
import os, sys, tempfile, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import accum_sched
from accum_sched import AccumulationEngine
model = torch.nn.Linear(3, 1)
AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "store"), rank=0,
                        world_size=1)
ddp = DDP(torch.nn.Linear(3, 1))
AccumulationEngine(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 2)
dist.destroy_process_group()
print(sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed" or m in (
    "accum_sched.backends.deepspeed", "accum_sched.backends.fsdp")))
"""


@pytest.mark.slow
def test_a_one_process_or_ddp_back_end_imports_no_deepspeed():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_the_deepspeed_helpers_are_exported_lazily():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = ("import sys, accum_sched; f = accum_sched.ensure_torch_extensions_dir; "
            "g = accum_sched.consolidated_state_dict; print(callable(f) and callable(g), 'deepspeed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


@pytest.mark.slow
def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports_after():
    """import_deepspeed() keeps DeepSpeed's autotuner from importing mlflow (about 1.6 s of every DeepSpeed worker's
    start-up here); mlflow, installed with the test extra, imports normally afterwards."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("mlflow")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DS_ACCELERATOR": "cpu"}
    code = ("import sys; from accum_sched.backends.deepspeed import import_deepspeed; ds = import_deepspeed(); "
            "from deepspeed.autotuning import autotuner; print(ds.__name__, 'mlflow' in sys.modules, "
            "autotuner.has_mlflow); import mlflow; print(mlflow.__name__, sys.modules['mlflow'] is mlflow)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-5:] == ["deepspeed", "False", "False", "mlflow", "True"], done.stdout
