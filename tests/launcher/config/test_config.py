"""Config contract and one-line errors (no workers started for bad input)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from launcher import cli
from launcher.config import load_config

CONTRACT = """\
run: {output_dir: runs/demo, seed: 0, epochs: 12}
task: {target: builtin:regression, args: {}}
data: {micro_batch_size: 16, shuffle: true, drop_last: false, num_workers: 0}
accumulation: {schedule: {0: 1, 4: 2, 8: 4}, normalize: elements}
optimizer: {name: adamw, lr: 0.001, weight_decay: 0.0}
lr_scheduler: {name: cosine, warmup_steps: 5}     # or null for a constant LR
distributed: {backend: ddp, nproc_per_node: 2}
"""


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_contract_is_accepted_exactly(tmp_path):
    cfg = load_config(write(tmp_path, CONTRACT))
    assert cfg.run.epochs == 12 and cfg.data.micro_batch_size == 16 and cfg.world_size == 2
    assert cfg.schedule.to_dict() == {0: 1, 4: 2, 8: 4}
    assert cfg.lr_scheduler.name == "cosine" and cfg.lr_scheduler.warmup_steps == 5
    nulled = load_config(write(tmp_path, CONTRACT.replace("{name: cosine, warmup_steps: 5}", "null")))
    assert nulled.lr_scheduler is None


def test_overrides_are_typed_by_the_schema(tmp_path):
    cfg = load_config(write(tmp_path, CONTRACT), ["optimizer.lr=0.01", "run.output_dir=123",
                                                  "accumulation.schedule=0:2,3:4", "data.shuffle=false"])
    assert cfg.optimizer.lr == 0.01 and cfg.run.output_dir == "123" and cfg.data.shuffle is False
    assert cfg.schedule.to_dict() == {0: 2, 3: 4}
    json_keys = load_config(write(tmp_path, CONTRACT.replace("{0: 1, 4: 2, 8: 4}", '{"0": 1, "4": 2}')))
    assert json_keys.schedule.to_dict() == {0: 1, 4: 2}


BAD = [
    ("schedule-negative", CONTRACT.replace("{0: 1, 4: 2, 8: 4}", "{0: 1, -4: 2}"), [], "accumulation.schedule"),
    ("schedule-zero", CONTRACT.replace("{0: 1, 4: 2, 8: 4}", "{0: 0}"), [], "accumulation.schedule"),
    ("schedule-string", CONTRACT.replace("{0: 1, 4: 2, 8: 4}", "'0:1,0:2'"), [], "accumulation.schedule"),
    ("unknown-key", CONTRACT.replace("seed: 0", "sed: 0"), [], "run.sed"),
    ("unknown-section", CONTRACT + "optimiser: {}\n", [], "optimiser"),
    ("wrong-type", CONTRACT.replace("micro_batch_size: 16", "micro_batch_size: sixteen"), [], "data.micro_batch_size"),
    ("wrong-bool", CONTRACT.replace("shuffle: true", "shuffle: 3"), [], "data.shuffle"),
    ("optimizer-name", CONTRACT.replace("name: adamw", "name: adamx"), [], "optimizer.name"),
    ("scheduler-name", CONTRACT.replace("name: cosine", "name: cosin"), [], "lr_scheduler.name"),
    ("task-module", CONTRACT.replace("builtin:regression", "no_such_module_xyz:make"), [], "task.target"),
    ("task-function", CONTRACT.replace("builtin:regression", "launcher.tasks.builtin:nope"), [], "task.target"),
    ("task-builtin", CONTRACT.replace("builtin:regression", "builtin:nope"), [], "task.target"),
    ("task-format", CONTRACT.replace("builtin:regression", "just_a_module"), [], "task.target"),
    ("yaml-syntax", CONTRACT.replace("epochs: 12}", "epochs: 12"), [], "config"),
    ("set-unknown", CONTRACT, ["optimizer.lrr=0.1"], "optimizer.lrr"),
    ("set-type", CONTRACT, ["run.epochs=many"], "run.epochs"),
    ("nproc-zero", CONTRACT, ["distributed.nproc_per_node=0"], "distributed.nproc_per_node"),
    ("sampler-name", CONTRACT, ["data.sampler=invarient"], "data.sampler"),
    ("invariant-deepspeed", CONTRACT, ["data.sampler=invariant", "distributed.backend=deepspeed",
                                       "distributed.deepspeed_config={}"], "data.sampler"),
    ("invariant-step-unit", CONTRACT, ["data.sampler=invariant", "accumulation.unit=step"], "data.sampler"),
    ("invariant-adaptive", CONTRACT, ["data.sampler=invariant", "accumulation.schedule=null",
                                      "accumulation.adaptive={min_factor: 1}"], "data.sampler"),
    ("invariant-drop-last", CONTRACT, ["data.sampler=invariant", "data.drop_last=true"], "data.sampler"),
]


@pytest.mark.parametrize("name,text,sets,field", BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_one_line_exit_2(tmp_path, capsys, monkeypatch, name, text, sets, field):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, text)
    argv = ["run", path] + [a for s in sets for a in ("--set", s)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert "; " in err[0]  # says how to fix it
    assert not (tmp_path / "runs").exists()  # nothing launched, nothing written


def test_error_messages_are_specific(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli.main(["check", write(tmp_path, CONTRACT.replace("sed", "x").replace("seed: 0", "sed: 0"))])
    assert "did you mean 'seed'" in capsys.readouterr().err
    cli.main(["check", write(tmp_path, CONTRACT.replace("epochs: 12}", "epochs: 12"))])
    err = capsys.readouterr().err
    assert "YAML syntax error" in err and "line " in err and "column " in err
    cli.main(["check", str(tmp_path / "missing.yaml")])
    assert "error: config: file" in capsys.readouterr().err


def test_cli_exit_code_and_no_traceback(tmp_path):
    path = write(tmp_path, CONTRACT.replace("name: adamw", "name: lion"))
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", path], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: optimizer.name: 'lion' is not one of sgd, adam, adamw nor an import path")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_check_prints_table_without_importing_torch(tmp_path):
    path = write(tmp_path, CONTRACT)
    code = ("import sys; from launcher.cli import main; rc = main(['check', %r, '--batches-per-epoch', '7']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)" % path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # epochs 0-3 at factor 1 (7 steps each), 4-7 at 2 (4 each), 8-11 at 4 (2 each): 28 + 16 + 8
    assert any(line.split()[:2] == ["0-3", "1"] and line.split()[-2:] == ["7", "28"] for line in lines), lines
    assert any(line.split()[:2] == ["8-11", "4"] and line.split()[4] == "128" for line in lines), lines
    assert "total optimizer steps over 12 epochs: 52" in proc.stdout
