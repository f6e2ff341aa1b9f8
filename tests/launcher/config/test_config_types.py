"""The typed config (launcher/config/sections.py): sections are frozen dataclasses, every key carries a doc and a
training mark, the reference in docs/cli.md is the one generated from them, and the checkpoint's config hash covers
exactly the marked keys at non-default values, so a checkpoint of the previous release still resumes."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import yaml

import paths
from launcher.checkpoint import resume, store
from launcher.config import (
    FSDPConfig,
    RunConfig,
    Section,
    apply_overrides,
    reference,
    sections,
    validate,
)
from launcher.config.schema import SCHEMA, SECTION_CLASSES, key_paths
from launcher.errors import ConfigError

ROOT = paths.ROOT_PATH
BASE = {"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 8}}


def config(*sets: str, **raw):
    """BASE with ``raw`` sections (``lr_scheduler=None``: written as null) and ``--set`` overrides."""
    return validate(apply_overrides({**BASE, **raw}, list(sets)))


# -- the sections -----------------------------------------------------------------------------------------------
def test_sections_are_frozen_dataclasses_with_the_mapping_api():
    cfg = config("distributed.backend=fsdp", "distributed.fsdp.param_dtype=bf16", lr_scheduler=None)
    assert type(cfg.run) is RunConfig and dataclasses.is_dataclass(cfg.run) and isinstance(cfg.run, Section)
    assert cfg.data.micro_batch_size == cfg.data["micro_batch_size"] == cfg.data.get("micro_batch_size") == 8
    assert cfg.data.get("nope", 5) == 5 and cfg.lr_scheduler is None
    assert type(cfg.distributed.fsdp) is FSDPConfig and cfg.distributed.fsdp["param_dtype"] == "bf16"
    assert cfg.distributed.fsdp == {**SCHEMA["distributed"]["fsdp"].default, "param_dtype": "bf16"}
    assert type(cfg.to_dict()["distributed"]["fsdp"]) is dict  # plain data for config.yaml and DeepSpeed
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.micro_batch_size = 4
    with pytest.raises(AttributeError, match="config section 'data' has no key 'nope'"):
        cfg.data.nope  # noqa: B018
    with pytest.raises(AttributeError, match="config has no section 'nope'"):
        cfg.nope  # noqa: B018
    assert list(cfg.to_dict()) == list(SCHEMA) and list(cfg.run) == list(SCHEMA["run"])


def test_every_key_declares_a_doc_and_a_mark():
    def walk(cls):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc") and isinstance(f.metadata.get("train"), bool), f"{cls.__name__}.{f.name}"
            if isinstance(f.default_factory, type) and issubclass(f.default_factory, Section):
                walk(f.default_factory)
    for cls in SECTION_CLASSES.values():
        walk(cls)
    with pytest.raises(TypeError):
        sections.key(1, doc="a key without its mark")  # train is required: every key says whether it is hashed


# what the checkpoint's hash covers; changing a mark is a decision about old checkpoints, made here on purpose
HASHED = {
    "run.seed", "run.epochs", "run.precision", "run.max_steps", "task.target", "task.args",
    "data.micro_batch_size", "data.shuffle", "data.drop_last", "data.shard", "data.sampler",
    *(f"accumulation.{k}" for k in ("schedule", "global_batch", "lr_coupling", "unit", "normalize", "uneven",
                                    "nonfinite", "noise_scale", "adaptive", "co_scale", "schedule_from")),
    *(f"optimizer.{k}" for k in ("name", "args", "no_decay", "lr", "weight_decay", "momentum", "betas", "eps",
                                 "max_grad_norm")),
    *(f"lr_scheduler.{k}" for k in ("name", "args", "warmup_steps", "min_lr")),
    "distributed.backend", "distributed.deepspeed_config", "distributed.fsdp.param_dtype",
    "distributed.fsdp.reduce_dtype",
}


# hashed keys added after that release (at their defaults, they leave its checkpoints' hashes unchanged)
ADDED_SINCE = {"run.max_steps", "data.shard", "accumulation.co_scale", "accumulation.schedule_from", "data.sampler"}


def _paths(config: dict, prefix: str = "") -> set[str]:
    """The key paths a manifest's config records (mapping-valued keys such as task.args are one key)."""
    out = set()
    for k, v in config.items():
        nested = isinstance(v, dict) and (not prefix or k == "fsdp")
        out |= _paths(v, f"{prefix}{k}.") if nested else {f"{prefix}{k}"}
    return out


def test_the_hashed_keys_are_the_marked_ones():
    assert {path for path, f in key_paths().items() if f.train} == HASHED
    # what the previous release hashed must stay hashed, or a checkpoint of that release made under a non-default
    # value of it would no longer be compared on it
    previous = _paths(PREVIOUS_DDP["config"]) | _paths(PREVIOUS_FSDP["config"])
    assert previous - {"lr_scheduler"} == HASHED - ADDED_SINCE  # (lr_scheduler: null in the FSDP one)
    not_hashed = {"run.output_dir", "data.num_workers", "distributed.timeout_s", "distributed.nproc_per_node",
                  "distributed.nnodes", "checkpoint.dir", "checkpoint.keep_last", "checkpoint.timeout_s",
                  "checkpoint.force_resume", "distributed.fsdp.gradient_sync", "distributed.fsdp.cpu_offload"}
    assert not not_hashed & HASHED
    assert not {p for p in key_paths() if p.split(".")[0] in ("logging", "slurm", "eval", "checkpoint")} & HASHED


# -- the reference in the docs ----------------------------------------------------------------------------------
def test_docs_hold_the_generated_reference():
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert reference.current(text) == reference.table(), "run: python -m launcher.config.reference --write"
    rows = re.findall(r"^\| `([a-z_.]+)` \|", reference.table(), re.MULTILINE)
    assert rows == list(key_paths())  # every key once, no stale one
    fsdp = (ROOT / "docs" / "fsdp.md").read_text(encoding="utf-8")
    assert re.findall(r"^\| `([a-z_]+)` \| `", fsdp, re.MULTILINE) == list(SCHEMA["distributed"]["fsdp"].schema)


def _stale(span: str) -> str | None:
    """The config key ``span`` (inline code of the docs) names, if the schema has no such key."""
    m = re.match(r"(" + "|".join(SCHEMA) + r")\.([a-z_]+)((?:\.[a-z_]+)*)", span)
    if not m or span[m.end():m.end() + 1] == "(" or m.group(0).endswith((".md", ".py", ".jsonl", ".json", ".yaml")):
        return None  # not a key: optimizer.step(), eval.jsonl
    field, deeper = SCHEMA[m.group(1)].get(m.group(2)), m.group(3).split(".")[1:]
    if field is None or (deeper and field.kind == "section" and deeper[0] not in field.schema) \
            or (deeper and field.kind not in ("section", "mapping", "any")):
        return m.group(0)
    return None


def test_docs_name_no_stale_key():
    assert _stale("data.shufle") == "data.shufle" and _stale("distributed.fsdp.reshard") == "distributed.fsdp.reshard"
    assert _stale("task.args.model") is None and _stale("optimizer.step()") is None and _stale("eval.jsonl") is None
    stale = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
        stale += [f"{page.name}: `{s}`" for s in map(_stale, re.findall(r"`([^`\n]+)`", prose)) if s]
        for block in re.findall(r"^```ya?ml\n(.*?)^```", text, re.DOTALL | re.MULTILINE):  # config fragments
            for section, body in yaml.safe_load(block).items():
                assert section in SCHEMA, f"{page.name}: a yaml block that is not config: {section}"
                for name, value in (body or {}).items():
                    field = SCHEMA[section].get(name)
                    if field is None:
                        stale.append(f"{page.name}: yaml {section}.{name}")
                    elif field.kind == "section":
                        stale += [f"{page.name}: yaml {section}.{name}.{k}" for k in value if k not in field.schema]
    assert not stale, "keys the schema does not have:\n" + "\n".join(stale)


# -- the hash ---------------------------------------------------------------------------------------------------
# a non-default value of every hashed key, as --set overrides; a context first where the key needs one
NON_DEFAULT = {
    "run.seed": ["run.seed=1"], "run.epochs": ["run.epochs=2"], "run.precision": ["run.precision=bf16"],
    "task.target": ["task.target=builtin:charlm"], "task.args": ["task.args={samples: 64}"],
    "data.micro_batch_size": ["data.micro_batch_size=4"], "data.shuffle": ["data.shuffle=false"],
    "data.drop_last": ["data.drop_last=true"], "run.max_steps": ["run.max_steps=100"],
    "data.shard": ["data.shard=none"], "data.sampler": ["data.sampler=invariant"],
    "accumulation.schedule": ["accumulation.schedule={0: 1, 2: 2}"],
    "accumulation.global_batch": ["accumulation.global_batch=16"],
    "accumulation.lr_coupling": ["accumulation.lr_coupling=linear"], "accumulation.unit": ["accumulation.unit=step"],
    "accumulation.normalize": ["accumulation.normalize=micro_batches"],
    "accumulation.uneven": ["accumulation.uneven=error"], "accumulation.nonfinite": ["accumulation.nonfinite=raise"],
    "accumulation.noise_scale": ["accumulation.noise_scale=true"],
    "accumulation.adaptive": ["accumulation.adaptive={min_factor: 2}"],
    "accumulation.co_scale": ["accumulation.co_scale={beta2: half_life}"],
    "accumulation.schedule_from": ["lr_scheduler.name=cosine", "accumulation.schedule_from={rule: smith}"],
    "optimizer.name": ["optimizer.name=sgd"], "optimizer.args": ["optimizer.args={amsgrad: true}"],
    "optimizer.no_decay": ["optimizer.no_decay=[bias]"], "optimizer.lr": ["optimizer.lr=0.01"],
    "optimizer.weight_decay": ["optimizer.weight_decay=0.1"],
    "optimizer.momentum": ["optimizer.name=sgd", "optimizer.momentum=0.9"],
    "optimizer.betas": ["optimizer.betas=[0.8, 0.9]"], "optimizer.eps": ["optimizer.eps=0.000001"],
    "optimizer.max_grad_norm": ["optimizer.max_grad_norm=1.0"],
    "lr_scheduler.name": ["lr_scheduler.name=cosine"],
    "lr_scheduler.args": ["lr_scheduler.name=torch.optim.lr_scheduler.StepLR", "lr_scheduler.args={step_size: 2}"],
    "lr_scheduler.warmup_steps": ["lr_scheduler.warmup_steps=3"],
    "lr_scheduler.min_lr": ["lr_scheduler.min_lr=0.00001"],
    "distributed.backend": ["distributed.backend=fsdp"],
    "distributed.deepspeed_config": ["distributed.deepspeed_config={zero_optimization: {stage: 0}}"],
    "distributed.fsdp.param_dtype": ["distributed.backend=fsdp", "distributed.fsdp.param_dtype=bf16"],
    "distributed.fsdp.reduce_dtype": ["distributed.backend=fsdp", "distributed.fsdp.reduce_dtype=float32"],
}


def test_every_hashed_key_at_a_non_default_value_changes_the_hash_and_is_named():
    assert set(NON_DEFAULT) == HASHED
    base = config()
    assert store.training_config(base) == {"task": {"target": "builtin:regression"}, "data": {"micro_batch_size": 8}}
    seen = {}
    for path, sets in NON_DEFAULT.items():
        context, cfg = config(*sets[:-1]), config(*sets)
        assert store.config_hash(cfg) != store.config_hash(context), path
        diffs = store.config_differences({"config_hash": store.config_hash(context),
                                          "config": store.training_config(context)}, cfg)
        assert [d[0] for d in diffs] == [path], path
        seen[store.config_hash(cfg)] = path
    assert len(seen) == len(NON_DEFAULT)  # all different


def test_keys_not_hashed_leave_the_hash_alone():
    base, fsdp = config(), config("distributed.backend=fsdp")
    assert store.config_hash(config("run.output_dir=elsewhere", "data.num_workers=2", "distributed.timeout_s=60",
                                    "distributed.nproc_per_node=4", "checkpoint.dir=/tmp/ck", "checkpoint.keep_last=5",
                                    "checkpoint.timeout_s=60", "checkpoint.force_resume=true", "logging.progress=none",
                                    "slurm.partition=gpu", "eval.every_n_steps=5",
                                    "run.compile=true")) == store.config_hash(base)
    assert store.config_hash(config("distributed.backend=fsdp", "distributed.fsdp.gradient_sync=every_micro_batch",
                                    "distributed.fsdp.cpu_offload=true")) == store.config_hash(fsdp)


def test_a_null_section_is_one_difference():
    with_null, without = config(lr_scheduler=None), config()
    assert store.training_config(with_null)["lr_scheduler"] is None
    manifest = {"config_hash": store.config_hash(with_null), "config": store.training_config(with_null)}
    assert store.config_differences(manifest, without) == [
        ("lr_scheduler", None, {"name": "constant", "args": {}, "warmup_steps": 0, "min_lr": 0.0})]
    assert store.config_differences(manifest, with_null) == []


# manifests as the previous release wrote them (every hashed key, defaults included), with its hashes
PREVIOUS_DDP = {"config_hash": "402fab9cbafaf47149d240c263408580ace3298a3ccc25c110f8822c5bc8edcf", "config": {
    "accumulation": {"adaptive": None, "global_batch": None, "lr_coupling": "none", "noise_scale": False,
                     "nonfinite": "skip", "normalize": "elements", "schedule": [[0, 1], [2, 2]], "uneven": "truncate",
                     "unit": "epoch"},
    "data": {"drop_last": False, "micro_batch_size": 8, "shuffle": True},
    "distributed": {"backend": "ddp", "deepspeed_config": None},
    "lr_scheduler": {"args": {}, "min_lr": 0.0, "name": "constant", "warmup_steps": 0},
    "optimizer": {"args": {}, "betas": None, "eps": None, "lr": 0.001, "max_grad_norm": None, "momentum": None,
                  "name": "adamw", "no_decay": [], "weight_decay": None},
    "run": {"epochs": 1, "precision": "fp32", "seed": 0},
    "task": {"args": {"samples": 64}, "target": "builtin:regression"}}}
PREVIOUS_FSDP = {"config_hash": "20b6d8b01459274dc5b8a2aba76a9304b84ffd952c918db0cb4cab0cdcdaf9e9", "config": {
    "accumulation": {"adaptive": None, "global_batch": None, "lr_coupling": "none", "noise_scale": False,
                     "nonfinite": "skip", "normalize": "elements", "schedule": None, "uneven": "truncate",
                     "unit": "epoch"},
    "data": {"drop_last": False, "micro_batch_size": 4, "shuffle": True},
    "distributed": {"backend": "fsdp", "deepspeed_config": None, "fsdp": {"param_dtype": "bf16", "reduce_dtype": None}},
    "lr_scheduler": None,
    "optimizer": {"args": {}, "betas": None, "eps": None, "lr": 0.001, "max_grad_norm": None, "momentum": None,
                  "name": "adamw", "no_decay": [], "weight_decay": None},
    "run": {"epochs": 1, "precision": "bf16", "seed": 0},
    "task": {"args": {}, "target": "builtin:charlm"}}}
DDP_SETS = ["task.args={samples: 64}", "accumulation.schedule={0: 1, 2: 2}", "distributed.nproc_per_node=2"]
FSDP_SETS = ["task.target=builtin:charlm", "data.micro_batch_size=4", "run.precision=bf16",
             "distributed.backend=fsdp", "distributed.fsdp.param_dtype=bf16",
             "distributed.fsdp.gradient_sync=every_micro_batch"]


@pytest.mark.parametrize("manifest, sets, raw", [(PREVIOUS_DDP, DDP_SETS, {}),
                                                (PREVIOUS_FSDP, FSDP_SETS, {"lr_scheduler": None})],
                         ids=["ddp", "fsdp"])
def test_a_checkpoint_of_the_previous_release_resumes_without_force_resume(tmp_path, manifest, sets, raw):
    cfg = config(*sets, f"run.output_dir={tmp_path}", **raw)
    assert store.config_hash(cfg) != manifest["config_hash"]  # the hash is new; the fields decide
    assert resume.check_config("ck", manifest, cfg) == []
    # on disk, through `accum-sched run --resume`'s own check
    tmp = store.step_dir(store.checkpoint_root(cfg), 4) + ".tmp"
    os.makedirs(tmp)
    with open(os.path.join(tmp, store.STATE), "wb") as f:
        f.write(b"state")
    store.commit(tmp, store.step_dir(store.checkpoint_root(cfg), 4),
                 {"format": store.FORMAT, "step": 4, "world_size": cfg.world_size, **json.loads(json.dumps(manifest))})
    resume.preflight(cfg, "auto")
    # a key it recorded, now at another value, is still refused by name
    with pytest.raises(ConfigError, match=r"^run.seed: is 3 but checkpoint .* was made with 0"):
        resume.preflight(config(*sets, f"run.output_dir={tmp_path}", "run.seed=3", **raw), "auto")
    # and so is a key added since, when set away from its default (here: one the old manifest does not hold)
    newer = json.loads(json.dumps(manifest))
    del newer["config"]["accumulation"]["uneven"]
    assert store.config_differences(newer, cfg) == []
    assert [d[0] for d in store.config_differences(newer, config(*sets, "accumulation.uneven=error", **raw))] == \
        ["accumulation.uneven"]
