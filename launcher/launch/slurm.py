"""sbatch scripts as a pure function of a `SlurmJob` (golden-file tested), and their submission. No torch here.

Two templates ship inside the package, in `launcher/templates/` (read with importlib.resources, so a wheel
install finds them as an editable one does): `torchrun` (one torchrun agent per node started by srun, c10d
rendezvous on the first node) and `per_task` (srun starts one `python -m launcher.worker` per rank). A template is
a bash script with `{{name}}` fields; shell's own `$VAR` / `${VAR}` pass through untouched. A field alone on its
line that renders empty (no setup lines) drops the line. Any other file path works as a template with the same
fields.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from launcher.errors import ConfigError

TEMPLATES = ("torchrun", "per_task")
_FIELD = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
_TIME = re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|INFINITE)")
_SIGNAL = re.compile(r"(?:(?P<flags>[A-Z]+):)?(?:SIG)?(?P<name>[A-Z0-9]+)(?:@(?P<secs>\d+))?")


def packaged_template(name: str):
    """The packaged template `name` (launcher/templates/<name>.sbatch, listed in pyproject's package-data) as an
    importlib.resources Traversable: found the same way from a wheel and from the repository."""
    return resources.files("launcher").joinpath("templates", f"{name}.sbatch")


@dataclass(frozen=True)
class SlurmJob:
    """Everything a rendered script depends on; absolute paths so the job runs from anywhere."""

    job_name: str
    workdir: str  # the job's working directory (where `accum-sched slurm` ran): relative task paths resolve here
    run_dir: str  # holds the script, config.yaml, slurm-<jobid>.out and the run's outputs
    config: str  # the resolved config the workers read
    python: str  # the interpreter (the venv's) that runs torchrun / the worker on the compute nodes
    template: str = "torchrun"
    nodes: int = 1
    nproc_per_node: int = 1  # workers per node (one per GPU when there are GPUs)
    gpus_per_node: int = 0
    cpus_per_worker: int = 1
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    signal: str = "USR2@90"  # sbatch --signal: the preemption warning, sent to every task of the job's steps
    requeue: bool = True
    max_restarts: int = 0  # torchrun's restarts of a failed worker group (torchrun template)
    resume: str | None = None  # --resume of the first run ("auto" or a checkpoint); requeued runs always resume
    extra_sbatch: tuple[str, ...] = ()  # further sbatch options, e.g. "--qos=high", "--constraint=a100"
    setup: tuple[str, ...] = field(default=())  # shell lines before the launch (module load, source a venv)


def parse_signal(spec: str, where: str = "slurm.signal") -> tuple[str, int | None]:
    """'USR2@90' -> ('USR2', 90). The workers must receive it, so a batch-shell-only 'B:' is refused."""
    m = _SIGNAL.fullmatch(spec.strip().upper())
    if not m or not hasattr(signal, "SIG" + m.group("name")):
        raise ConfigError(where, f"{spec!r} is not a signal spec", "write NAME[@SECONDS], e.g. USR2@90 or USR1@120")
    if m.group("flags") and "B" in m.group("flags"):
        raise ConfigError(where, f"{spec!r} signals only the batch shell, not the workers",
                          "drop 'B:' so srun's tasks receive it")
    if m.group("name") in ("KILL", "STOP"):
        raise ConfigError(where, f"SIG{m.group('name')} cannot be caught", "use USR2 (or USR1 without NCCL)")
    return m.group("name"), None if m.group("secs") is None else int(m.group("secs"))


def check_job(job: SlurmJob) -> None:
    """Refuse values that would make a broken script; errors name the config field behind each value."""
    if job.template not in TEMPLATES and not os.path.isfile(job.template):
        raise ConfigError("slurm.template", f"{job.template!r} is neither {' nor '.join(TEMPLATES)} nor a file",
                          "use a built-in template or the path of your own .sbatch template")
    for name, low in (("nodes", 1), ("nproc_per_node", 1), ("gpus_per_node", 0), ("cpus_per_worker", 1),
                      ("max_restarts", 0)):
        if getattr(job, name) < low:
            raise ConfigError(_FIELD_OF[name], f"must be >= {low}, got {getattr(job, name)}", "give a larger number")
    if job.gpus_per_node and job.gpus_per_node != job.nproc_per_node:
        raise ConfigError("slurm.gpus_per_node", f"{job.gpus_per_node} GPUs per node but distributed.nproc_per_node "
                                                 f"is {job.nproc_per_node}",
                          "one worker per GPU: make them equal (--gpus-per-node sets both)")
    if job.time is not None and not _TIME.fullmatch(job.time):
        raise ConfigError("slurm.time", f"{job.time!r} is not a SLURM time",
                          "write MINUTES, HH:MM:SS or D-HH:MM:SS, e.g. 2-00:00:00")
    parse_signal(job.signal)
    for name in ("job_name", "partition", "account", "workdir", "run_dir", "config", "python"):
        value = getattr(job, name)
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ConfigError(_FIELD_OF[name], f"{value!r} is empty or holds white space, which #SBATCH lines "
                                               f"cannot carry", "choose a value without spaces")
    for i, opt in enumerate(job.extra_sbatch):
        if not opt.startswith("-") or "\n" in opt:
            raise ConfigError(f"slurm.extra_sbatch[{i}]", f"{opt!r} is not one sbatch option",
                              "write e.g. '--qos=high'")
    for i, line in enumerate(job.setup):
        if "\n" in line:
            raise ConfigError(f"slurm.setup[{i}]", "holds a line break", "give one shell line per list item")


_FIELD_OF = {"nodes": "distributed.nnodes", "nproc_per_node": "distributed.nproc_per_node",
             "gpus_per_node": "slurm.gpus_per_node", "cpus_per_worker": "slurm.cpus_per_worker",
             "max_restarts": "distributed.max_restarts", "job_name": "slurm.job_name",
             "partition": "slurm.partition", "account": "slurm.account", "workdir": "working directory",
             "run_dir": "run.output_dir", "config": "run.output_dir", "python": "python interpreter"}


def _cpus_per_task(job: SlurmJob) -> int:
    # torchrun: one task per node runs every worker of the node; per_task: one task is one worker.
    return job.cpus_per_worker * (job.nproc_per_node if job.template == "torchrun" else 1)


def sbatch_header(job: SlurmJob) -> list[str]:
    """The #SBATCH lines, in a fixed order (golden files depend on it)."""
    per_node = 1 if job.template == "torchrun" else job.nproc_per_node
    # sbatch expands %j (job id) in --output; a literal % in the run directory must be written %%.
    output = os.path.join(job.run_dir.replace("%", "%%"), "slurm-%j.out")
    opts = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", f"--ntasks-per-node={per_node}",
            f"--cpus-per-task={_cpus_per_task(job)}"]
    if job.gpus_per_node:
        opts.append(f"--gpus-per-node={job.gpus_per_node}")
    opts += [f"--{name}={getattr(job, name)}" for name in ("partition", "time", "account")
             if getattr(job, name) is not None]
    opts.append(f"--signal={job.signal}")
    opts.append("--requeue" if job.requeue else "--no-requeue")
    # append: a requeued job writes to the same file; truncating it would lose the first run's log.
    opts += ["--open-mode=append", f"--output={output}", f"--chdir={job.workdir}", *job.extra_sbatch]
    return [f"#SBATCH {o}" for o in opts]


def fields(job: SlurmJob) -> dict[str, str]:
    name, secs = parse_signal(job.signal)
    return {
        "sbatch_header": "\n".join(sbatch_header(job)),
        "workdir": shlex.quote(job.workdir),
        "setup": "\n".join(job.setup),
        "python": shlex.quote(job.python),
        "config": shlex.quote(job.config),
        "nodes": str(job.nodes),
        "nproc_per_node": str(job.nproc_per_node),
        "cpus_per_task": str(_cpus_per_task(job)),
        "cpus_per_worker": str(job.cpus_per_worker),
        "max_restarts": str(job.max_restarts),
        "preempt_signal": name,
        "resume": shlex.quote(job.resume or ""),
        # Leave the workers most of the warning time to reach a boundary and checkpoint; 60 s without a warning.
        "shutdown_timeout": str(max(10, secs - 15) if secs is not None else 60),
    }


def render(job: SlurmJob, template_text: str) -> str:
    """The sbatch script for `job` from a template's text. Pure: same inputs, same bytes."""
    check_job(job)
    values = fields(job)
    out = []
    for line in template_text.splitlines():
        unknown = [m.group(1) for m in _FIELD.finditer(line) if m.group(1) not in values]
        if unknown:
            raise ConfigError("slurm.template", f"unknown field {{{{{unknown[0]}}}}}",
                              f"known fields: {', '.join(sorted(values))}")
        rendered = _FIELD.sub(lambda m: values[m.group(1)], line)
        if rendered.strip() == "" and _FIELD.fullmatch(line.strip() or "-"):
            continue  # an optional block (setup) that is empty
        out.append(rendered)
    return "\n".join(out) + "\n"


def template_text(template: str) -> str:
    """The text of a named template (`torchrun`, `per_task`) or of a template file."""
    if template not in TEMPLATES:
        return Path(template).read_text(encoding="utf-8")
    packaged = packaged_template(template)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    raise ConfigError("slurm.template", f"template {template!r} not found in the installed package ({packaged})",
                      "reinstall accum-sched, or give the path of a template file")


def render_job(job: SlurmJob) -> str:
    check_job(job)  # before reading the template: a missing template file is a config error too
    return render(job, template_text(job.template))


class SbatchError(Exception):
    """sbatch refused the script; `output` is sbatch's own message, shown to the user as is."""

    def __init__(self, returncode: int, output: str):
        self.returncode, self.output = returncode, output
        super().__init__(output)


def submit(script_path: str, env: dict | None = None, sbatch: str = "sbatch") -> str:
    """Submit with `sbatch --parsable` and return the job id (`123` or `123;cluster`)."""
    try:
        done = subprocess.run([sbatch, "--parsable", script_path], capture_output=True, text=True, env=env,
                              timeout=120)
    except FileNotFoundError:
        raise SbatchError(127, f"{sbatch}: command not found") from None
    except subprocess.TimeoutExpired:
        raise SbatchError(124, f"{sbatch} did not answer within 120 s") from None
    if done.returncode != 0:
        raise SbatchError(done.returncode, (done.stderr + done.stdout).strip())
    job_id = done.stdout.strip().splitlines()[-1].split(";")[0] if done.stdout.strip() else ""
    if not job_id.isdigit():
        raise SbatchError(done.returncode, f"sbatch printed no job id: {(done.stdout + done.stderr).strip()!r}")
    return job_id
