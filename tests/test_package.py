"""The package as a user gets it: build the wheel, install it into a fresh venv, run it from outside the repository.

An editable install finds everything through the repository, so a file the wheel forgets (the SLURM templates,
builtin:charlm's corpus) goes unnoticed there. Here the wheel is built from a copy of the sources (the repository
gets no build/ or egg-info), installed with --no-deps into a new venv that borrows this environment's installed
dependencies (torch, numpy, yaml) through a .pth line, and run with no PYTHONPATH from an empty directory:
`accum-sched slurm --dry-run` must print the very script the repository renders, and a short 2-worker
`accum-sched run` must train with the installed `launcher` and `accum_sched` on every rank (a probe task records
which files they were imported from)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the slow tier (docs/testing.md)

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("launcher/templates/torchrun.sbatch", "launcher/templates/per_task.sbatch", "launcher/data/corpus.txt")

PROBE = '''\
"""A task that records, per rank, where the worker imported the package from, then trains builtin:regression."""
import json
import os

import accum_sched
import launcher
from launcher.tasks.builtin import regression as _regression


def regression(**args):
    with open(os.environ["PROBE_OUT"] + "." + os.environ.get("RANK", "0"), "w") as f:
        json.dump({"launcher": launcher.__file__, "accum_sched": accum_sched.__file__}, f)
    return _regression(**args)
'''

CONFIG = """\
run: {output_dir: runs/wheel, seed: 0, epochs: 2}
task: {target: "wheel_probe:regression", args: {samples: 64}}
data: {micro_batch_size: 8, shuffle: true}
accumulation: {schedule: {0: 1, 1: 2}}
optimizer: {name: sgd, lr: 0.01}
distributed: {backend: ddp, nproc_per_node: 2}
logging: {progress: plain, tensorboard: "off"}
"""


def _run(argv, **kw):
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=kw.pop("timeout", 180),
                          **kw)
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("accum_sched", "launcher"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # no isolation: setuptools comes from this environment, nothing is downloaded
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src])
    (wheel,) = (tmp / "dist").glob("accum_sched-*.whl")
    return wheel


def _venv_with_wheel(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # The dependencies: this environment's site-packages, appended to the new venv's path. A plain path line does
    # not run the .pth files there, so this environment's editable accum-sched (the repository) stays out.
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "borrowed_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    return venv


def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(SHIPPED) <= names, sorted(n for n in names if not n.endswith(".py"))
    venv = _venv_with_wheel(tmp_path, wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "demo.yaml").write_text(CONFIG)
    (work / "wheel_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PROBE_OUT=str(work / "probe"))
    installed = Path(_run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          cwd=work, env=env).stdout.strip())

    # the installed command renders exactly the script the repository renders (the packaged templates)
    script = _run([venv / "bin" / "accum-sched", "slurm", "demo.yaml", "--dry-run"], cwd=work, env=env).stdout
    repo_env = dict(env, PYTHONPATH=str(ROOT))
    here = _run([sys.executable, "-m", "launcher", "slurm", "demo.yaml", "--dry-run"], cwd=work, env=repo_env).stdout
    assert script.startswith("#!/bin/bash\n") and f"{venv / 'bin' / 'python'} -m torch.distributed.run" in script
    assert script == here.replace(sys.executable, str(venv / "bin" / "python"))
    assert sorted(p.name for p in work.iterdir()) == ["demo.yaml", "wheel_probe.py"]  # a dry run writes nothing
    corpus = _run([venv / "bin" / "python", "-c", "from launcher.tasks.builtin import CORPUS; print(CORPUS)"],
                  cwd=work, env=env).stdout.strip()
    assert Path(corpus).is_file() and Path(corpus).is_relative_to(installed), corpus

    # a short real run, every rank on the installed package
    _run([venv / "bin" / "accum-sched", "run", "demo.yaml"], cwd=work, env=env, timeout=240)
    run_dir = work / "runs" / "wheel"
    assert (run_dir / "model.pt").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    # 64 samples over 2 ranks in micro-batches of 8: 4 per rank per epoch; factor 1 then 2
    assert summary["world_size"] == 2 and summary["optimizer_steps"] == 4 + 2, summary
    for rank in (0, 1):
        where = json.loads((work / f"probe.{rank}").read_text())
        for name, path in where.items():
            assert Path(path).is_relative_to(installed), (rank, name, path)
            assert not Path(path).is_relative_to(ROOT), (rank, name, path)
