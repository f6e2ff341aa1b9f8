"""sbatch rendering (golden files) and `accum-sched slurm --dry-run`: pure, no SLURM and no torch needed.

Regenerate the golden files after an intended change with ACCUM_SCHED_UPDATE_GOLDEN=1 and review the diff."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import paths
from launcher.errors import ConfigError
from launcher.launch.slurm import SlurmJob, parse_signal, render, render_job, sbatch_header

GOLDEN = Path(__file__).parent / "golden"
ROOT = paths.ROOT_PATH
BASE = SlurmJob(job_name="accum-demo", workdir="/home/ada/project", run_dir="/home/ada/project/runs/demo",
                config="/home/ada/project/runs/demo/config.yaml", python="/home/ada/venv/bin/python")
CASES = {
    "torchrun_cpu": dataclasses.replace(BASE, nproc_per_node=2),
    "torchrun_gpu": dataclasses.replace(BASE, nodes=4, nproc_per_node=8, gpus_per_node=8, cpus_per_worker=6,
                                        partition="gpu", time="2-00:00:00", account="proj42", signal="USR1@300",
                                        max_restarts=2, setup=("module load cuda/12.4",), resume="auto"),
    "per_task_gpu": dataclasses.replace(BASE, template="per_task", nodes=2, nproc_per_node=4, gpus_per_node=4,
                                        cpus_per_worker=8, time="04:00:00", extra_sbatch=("--qos=high",
                                        "--constraint=a100"), setup=("source /home/ada/venv/bin/activate",)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    script = render_job(CASES[name])
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("ACCUM_SCHED_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(script)
    assert script == path.read_text(), f"rendered script differs from {path} (see the module docstring)"
    # real bash parses it, and the same job renders the same bytes (a pure function)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert render_job(CASES[name]) == script


def test_header_follows_the_template_shape():
    torchrun = sbatch_header(CASES["torchrun_gpu"])
    assert "#SBATCH --ntasks-per-node=1" in torchrun and "#SBATCH --cpus-per-task=48" in torchrun
    per_task = sbatch_header(CASES["per_task_gpu"])
    assert "#SBATCH --ntasks-per-node=4" in per_task and "#SBATCH --cpus-per-task=8" in per_task
    assert "#SBATCH --no-requeue" in sbatch_header(dataclasses.replace(BASE, requeue=False))
    # a literal % in the run directory must not become a filename pattern
    odd = sbatch_header(dataclasses.replace(BASE, run_dir="/runs/100%"))
    assert "#SBATCH --output=/runs/100%%/slurm-%j.out" in odd


@pytest.mark.parametrize("change, field, fragment", [
    ({"time": "1:30:00:00"}, "slurm.time", "is not a SLURM time"),
    ({"signal": "B:USR2@90"}, "slurm.signal", "only the batch shell"),
    ({"signal": "USR9"}, "slurm.signal", "is not a signal spec"),
    ({"signal": "KILL@60"}, "slurm.signal", "cannot be caught"),
    ({"gpus_per_node": 4}, "slurm.gpus_per_node", "4 GPUs per node but distributed.nproc_per_node is 1"),
    ({"run_dir": "/my runs/demo"}, "run.output_dir", "white space"),
    ({"partition": "gpu\n#SBATCH --x"}, "slurm.partition", "white space"),
    ({"extra_sbatch": ("qos=high",)}, "slurm.extra_sbatch[0]", "is not one sbatch option"),
    ({"template": "/no/such.sbatch"}, "slurm.template", "neither"),
    ({"nodes": 0}, "distributed.nnodes", "must be >= 1"),
])
def test_bad_jobs_name_their_field(change, field, fragment):
    with pytest.raises(ConfigError) as err:
        render_job(dataclasses.replace(BASE, **change))
    assert err.value.field == field and fragment in err.value.problem, err.value.line()


@pytest.mark.parametrize("template", ["torchrun", "per_task"])
def test_resume_only_when_requeued_or_asked(template):
    """The rendered script's own bash decides: SLURM_RESTART_COUNT > 0 resumes the newest checkpoint, a first run
    resumes only with the --resume it was submitted with (a path is kept: the worker prefers newer ones on a
    requeue, launcher/checkpoint/checkpointer.py)."""
    def worker_args(resume, restarts):
        script = render_job(dataclasses.replace(BASE, template=template, resume=resume))
        lines = script.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("resume="))
        probe = "\n".join(lines[start:start + 2] + ['printf "%s|" ${resume:+--resume "$resume"}'])
        env = {"PATH": os.environ["PATH"]} | ({} if restarts is None else {"SLURM_RESTART_COUNT": str(restarts)})
        return subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True).stdout

    assert worker_args(None, None) == "|" and worker_args(None, 0) == "|"  # printf of nothing prints one "|"
    assert worker_args(None, 1) == "--resume|auto|"
    assert worker_args("auto", None) == "--resume|auto|" and worker_args("auto", 2) == "--resume|auto|"
    assert worker_args("/ck pts/step-00000010", 0) == "--resume|/ck pts/step-00000010|"  # one argument
    assert worker_args("/ck pts/step-00000010", 1) == "--resume|/ck pts/step-00000010|"


def test_custom_template_and_unknown_field(tmp_path):
    own = tmp_path / "own.sbatch"
    own.write_text("#!/bin/bash\n{{sbatch_header}}\n{{setup}}\n"
                   "srun {{python}} -m launcher.worker --config {{config}}\n")
    script = render_job(dataclasses.replace(BASE, template=str(own)))
    assert script.splitlines()[-1] == "srun /home/ada/venv/bin/python -m launcher.worker --config " \
                                      "/home/ada/project/runs/demo/config.yaml"
    assert "\n\n" not in script  # the empty setup block left no blank line
    with pytest.raises(ConfigError, match=r"unknown field \{\{nodez\}\}"):
        render(BASE, "{{nodez}}\n")
    assert parse_signal("SIGUSR2@90") == ("USR2", 90) and parse_signal("usr1") == ("USR1", None)


def _cli(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "launcher", "slurm", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=60)


def test_dry_run_prints_writes_nothing_and_never_imports_torch(tmp_path):
    cfg = ROOT / "configs" / "demo.yaml"
    done = _cli(str(cfg), "--dry-run", "--template", "per_task", "--time", "1:30:00", "--cpus-per-task", "2",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert f"#SBATCH --output={tmp_path}/runs/demo/slurm-%j.out" in script
    assert "#SBATCH --time=1:30:00" in script  # given on the command line, kept as written
    assert "#SBATCH --ntasks-per-node=2" in script and "--cpus-per-task=2" in script
    assert f"-m launcher.worker --config {tmp_path}/runs/demo/config.yaml ${{resume:+--resume" in script
    assert "\nresume=''\n" in script  # a fresh submission: only a requeued run resumes
    assert f"{sys.executable} -m launcher.worker" in script
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
    # the whole command (config load, task check, rendering) without torch
    code = ("import sys; from launcher.cli import main; rc = main(['slurm', %r, '--dry-run']); "
            "sys.exit(3 if 'torch' in sys.modules else rc)" % str(cfg))
    probe = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr


def test_cli_errors_are_one_line_exit_2(tmp_path):
    cfg = str(ROOT / "configs" / "demo.yaml")
    bad_time = _cli(cfg, "--dry-run", "--set", "slurm.time=1:30:00", cwd=tmp_path)  # unquoted: YAML's 5400
    assert bad_time.returncode == 2 and bad_time.stderr.startswith("error: slurm.time: 5400 is a number")
    assert bad_time.stderr.count("\n") == 1
    gpus = _cli(cfg, "--dry-run", "--gpus-per-node", "2", "--nproc-per-node", "4", cwd=tmp_path)
    assert gpus.returncode == 2 and gpus.stderr.startswith("error: slurm.gpus_per_node: ")
    unknown = _cli(cfg, "--dry-run", "--set", "slurm.partion=gpu", cwd=tmp_path)
    assert unknown.returncode == 2 and "did you mean 'partition'" in unknown.stderr
    # no sbatch on this PATH: the shell's own words, a hint, exit 2, and the script is left for inspection
    nosbatch = _cli(cfg, cwd=tmp_path, env=dict(os.environ, PATH="/nonexistent"))
    assert nosbatch.returncode == 2, nosbatch.stderr
    assert nosbatch.stderr.splitlines()[0] == "sbatch: command not found"
    assert "run this on a SLURM login node, or use --dry-run" in nosbatch.stderr
    assert (tmp_path / "runs" / "demo" / "job.sbatch").is_file()
