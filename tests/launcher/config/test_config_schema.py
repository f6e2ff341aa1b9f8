"""The config on pydantic (issue 35.4) and the first-day frictions of issue 37: every key reachable by a dotted
--set, duplicate YAML keys refused, the mapping-valued keys checked by their typed options, one-line errors for the
rest, `accum-sched schema` checked the way an editor uses it, and the config's hash unchanged for shipped configs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jsonschema
import pytest
import yaml

import paths
from launcher import cli
from launcher.checkpoint import store
from launcher.cli import check
from launcher.config import load_config
from launcher.config.json_schema import config_schema

ROOT = str(paths.ROOT_PATH)
DEMO = os.path.join(ROOT, "configs", "demo.yaml")


def write(tmp_path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def one_line_exit_2(tmp_path, capsys, argv: list[str]) -> str:
    """Run ``argv`` as `check` and as `run`: exit 2, one stderr line (returned), nothing written."""
    before = sorted(os.listdir(tmp_path))
    line = None
    for command in ("check", "run"):
        assert cli.main([command, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "; " in err[0], err
        assert line in (None, err[0])
        line = err[0]
    assert sorted(os.listdir(tmp_path)) == before  # nothing launched, nothing written
    return line


# -- --set reaches every key by its dotted path -------------------------------------------------------------------
def test_set_reaches_any_key_by_its_dotted_path(tmp_path):
    cfg = load_config(DEMO, ["task.args.n=200", "task.args.nested.deep=1", "accumulation.schedule={0: 1, 5: 2}",
                             "accumulation.adaptive.min_factor=2", "accumulation.schedule=null",
                             "lr_scheduler.name=constant", "distributed.nproc_per_node=2"])
    assert cfg.task.args == {"n": 200, "nested": {"deep": 1}} and cfg.accumulation.adaptive == {"min_factor": 2}
    fsdp = load_config(DEMO, ["distributed.backend=fsdp", "distributed.fsdp.mesh=[1,2]"])
    assert fsdp.distributed.fsdp.mesh == [1, 2] and fsdp.distributed.fsdp["mesh"] == [1, 2]
    one = load_config(DEMO, ["accumulation.schedule={0: 1, 5: 2}", "accumulation.schedule.9=4"])
    assert one.schedule.to_dict() == {0: 1, 5: 2, 9: 4}
    # the file's own mapping keeps its other keys: one value changed, not the whole mapping retyped
    path = write(tmp_path, open(DEMO).read().replace("args: {}", "args: {samples: 64, noise: 0.1}"))
    assert load_config(path, ["task.args.samples=200"]).task.args == {"samples": 200, "noise": 0.1}


@pytest.mark.parametrize("override,start", [
    ("task.args.samplez=3", "error: task.args.samplez: builtin:regression takes no argument 'samplez'; "
                            "did you mean 'samples'?"),
    ("run.epochs.x=1", "error: --set: 'run.epochs.x' goes inside run.epochs"),
    ("distributed.fsdp.mseh=[2,2]", "error: distributed.fsdp.mseh: unknown key; did you mean 'mesh'?"),
    ("run.compile={mode: fast}", "error: run.compile.mode: 'fast' is not one of default, reduce-overhead"),
    ("accumulation.co_scale={lr: linaer}", "error: accumulation.co_scale.lr: 'linaer' is not one of none, linear, "
                                           "sqrt, auto; did you mean 'linear'?"),
    ("accumulation.schedule_from={max_factor: 4}", "error: accumulation.schedule_from.rule: is required"),
    ("accumulation.adaptive={min_factor: 4, max_factor: 2}", "error: accumulation.adaptive.max_factor: 2 is below "
                                                             "min_factor 4; give max_factor >= min_factor"),
    ("eval.early_stop={patience: 0}", "error: eval.early_stop.patience: must be >= 1, got 0"),
    ("distributed.stop_poll_every=0", "error: distributed.stop_poll_every: must be >= 1, got 0"),
    ("distributed.stop_poll_min_ms=-5", "error: distributed.stop_poll_min_ms: must be >= 0, got -5"),
    ("logging.wandb={projct: p}", "error: logging.wandb.projct: unknown key; did you mean 'project'?"),
    ("logging.mlflow={run_name: r}", "error: logging.mlflow.experiment: is required"),
    ("run.compile=[1]", "error: run.compile: expected true or false or a mapping, got [1]"),
])
def test_bad_values_anywhere_are_one_line_naming_the_path(tmp_path, capsys, monkeypatch, override, start):
    monkeypatch.chdir(tmp_path)
    line = one_line_exit_2(tmp_path, capsys, [DEMO, "--set", override])
    assert line.startswith(start), line


# -- issue 37: duplicate keys, a directory, YAML's booleans, too many workers -----------------------------------
@pytest.mark.parametrize("text,words", [
    ("accumulation: {schedule: {0: 1, 0: 4}}", "the key '0' is written twice in one mapping (lines 3 and 3)"),
    ("run: {epochs: 1}\nrun: {epochs: 2}", "the key 'run' is written twice in one mapping (lines 3 and 4)"),
    ("optimizer:\n  lr: 0.1\n  name: sgd\n  lr: 0.2", "the key 'lr' is written twice in one mapping (lines 4 and 6)"),
])
def test_a_key_written_twice_is_refused(tmp_path, capsys, monkeypatch, text, words):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "task: {target: builtin:regression}\ndata: {micro_batch_size: 4}\n" + text + "\n")
    line = one_line_exit_2(tmp_path, capsys, [path])
    assert line.startswith("error: config: ") and words in line and "keep one" in line, line
    line = one_line_exit_2(tmp_path, capsys, [DEMO, "--set", "accumulation.schedule={0: 1, 0: 4}"])
    assert line.startswith("error: --set accumulation.schedule: the key '0' is written twice"), line


def test_aliases_may_still_override_merged_keys(tmp_path):
    path = write(tmp_path, """\
        task: {target: builtin:regression}
        data: &d {micro_batch_size: 4, shuffle: true}
        eval: {micro_batch_size: 8}
        slurm: {partition: a}
        checkpoint: {keep_last: 3}
        """)
    assert load_config(path).data.micro_batch_size == 4
    merged = write(tmp_path, "base: &b {micro_batch_size: 4, shuffle: true}\n", "merged.yaml")
    from launcher.config import schema
    assert schema.safe_load(open(merged).read() + "data: {<<: *b, shuffle: false}\n")["data"] == {
        "micro_batch_size": 4, "shuffle": False}


def test_a_directory_is_named_as_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    line = one_line_exit_2(tmp_path, capsys, [str(tmp_path / "runs")])
    assert line == f"error: config: {str(tmp_path / 'runs')!r} is a directory, not a config file; give the path of " \
                   "a YAML file (accum-sched run CONFIG.yaml)", line
    (tmp_path / "runs" / "config.yaml").write_text("{}")
    line = one_line_exit_2(tmp_path, capsys, [str(tmp_path / "runs")])
    assert line.endswith(f"give {tmp_path / 'runs' / 'config.yaml'} (a run directory's resolved config)"), line


def test_yaml_booleans_switch_tensorboard(tmp_path):
    for written, meant in (("false", "off"), ("true", "on"), ("off", "off"), ("on", "on"), ("auto", "auto")):
        path = write(tmp_path, open(DEMO).read() + f"logging: {{tensorboard: {written}}}\n")
        assert load_config(path).logging.tensorboard == meant, written
        assert load_config(DEMO, [f"logging.tensorboard={written}"]).logging.tensorboard == meant, written


def test_more_workers_than_cores_is_a_warning_naming_both(capsys):
    cfg = load_config(DEMO, ["distributed.nproc_per_node=64"])
    assert check.warn_oversubscribed(cfg, available=2)
    err = capsys.readouterr().err
    assert err.startswith("warning: distributed.nproc_per_node is 64 but this machine has 2 CPU core(s)"), err
    assert not check.warn_oversubscribed(load_config(DEMO), available=2) and capsys.readouterr().err == ""
    proc = subprocess.run([sys.executable, "-m", "launcher", "check", DEMO, "--set",
                           f"distributed.nproc_per_node={check.cores() + 1}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr  # a warning, not an error
    assert f"is {check.cores() + 1} but this machine has {check.cores()} CPU core(s)" in proc.stderr


# -- the JSON Schema --------------------------------------------------------------------------------------------
def test_schema_command_prints_what_editors_check_configs_with(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import sys; from launcher.cli import main; rc = main(['schema']); "
                           "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert schema == json.loads(json.dumps(config_schema()))
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    shipped = [os.path.join(ROOT, "configs", f) for f in sorted(os.listdir(os.path.join(ROOT, "configs")))
               if f.endswith(".yaml")]
    assert len(shipped) >= 5
    for path in shipped:  # what the loader accepts, the editor accepts (YAML's int keys as JSON's strings)
        data = json.loads(json.dumps(yaml.safe_load(open(path))))
        assert not list(validator.iter_errors(data)), path
    demo = json.loads(json.dumps(yaml.safe_load(open(DEMO))))
    for section, key, value in (("run", "sed", 1), ("data", "micro_batch_size", "16"), ("optimizer", "name", 3),
                                ("distributed", "backend", "fdsp"), ("accumulation", "co_scale", {"lr": "x"}),
                                ("data", "micro_batch_size", 0)):
        bad = json.loads(json.dumps(demo))
        bad[section][key] = value
        assert list(validator.iter_errors(bad)), (section, key, value)
    demo["logging"] = {"tensorboard": False}  # YAML's false: off, for the editor too
    assert not list(validator.iter_errors(demo))
    del demo["task"]
    assert list(validator.iter_errors(demo))  # a required section
    hashed = schema["$defs"]["OptimizerConfig"]["properties"]["lr"]
    assert hashed["x-hashed"] is True and hashed["description"] == "learning rate" and hashed["default"] == 0.001
    out = tmp_path / "accum-sched.schema.json"
    assert cli.main(["schema", "--output", str(out)]) == 0 and json.loads(out.read_text()) == schema


# -- the hash of what existed keeps its value ------------------------------------------------------------------------
def test_shipped_configs_hash_as_before(monkeypatch):
    """shipped_hashes.json: [config, --set overrides, hash], computed by the hand-written validation of the commit
    before the config moved onto pydantic; a checkpoint's config hash must not change with the validator."""
    monkeypatch.chdir(ROOT)
    recorded = json.loads((paths.TESTS_PATH / "launcher" / "config" / "shipped_hashes.json").read_text())
    assert len(recorded) >= 10
    for path, sets, digest in recorded:
        assert store.config_hash(load_config(path, sets)) == digest, (path, sets)


# -- a back end's option is one declaration in its own module ------------------------------------------------------
ADDED_BACKEND = '''if True:
    import json, sys
    from launcher import backends
    from launcher.backends.base import LauncherBackend
    from launcher.options import Section, key, section

    @section(path="distributed.minimal")
    class MinimalOptions(Section):
        level: int = key(1, train=True, check=lambda v: None if v <= 3 else f"must be <= 3, got {v}",
                         doc="how minimal")

    class MinimalLauncherBackend(LauncherBackend):  # the module a new back end adds
        name = "minimal"
        options = {"minimal": (MinimalOptions, key(MinimalOptions, train=True, doc="the minimal back end's options"))}

        def setup(self, *a):
            raise NotImplementedError

        def final_state_dict(self, *a):
            raise NotImplementedError

    backends._BACKENDS["minimal"] = MinimalLauncherBackend()  # the registry line

    from launcher.config import load_config, reference
    from launcher.config.json_schema import config_schema
    from launcher.errors import ConfigError

    cfg = load_config("configs/demo.yaml", ["distributed.backend=minimal", "distributed.minimal.level=3"])
    row = "| `distributed.minimal.level` | 1 | yes |"
    out = {"level": cfg.distributed.minimal.level, "row": row in reference.table(),
           "schema": "MinimalOptions" in config_schema()["$defs"]}
    for bad in ("distributed.minimal.level=4", "distributed.minimal.levle=2"):
        try:
            load_config("configs/demo.yaml", ["distributed.backend=minimal", bad])
        except ConfigError as exc:
            out[bad] = exc.line()
    print(json.dumps(out))
'''


def test_a_back_end_with_an_option_is_its_module_and_a_registry_line():
    proc = subprocess.run([sys.executable, "-c", ADDED_BACKEND], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["level"] == 3 and out["row"] and out["schema"], out
    assert out["distributed.minimal.level=4"] == "distributed.minimal.level: must be <= 3, got 4; change the value"
    assert out["distributed.minimal.levle=2"].startswith("distributed.minimal.levle: unknown key; did you mean "
                                                         "'level'?")
