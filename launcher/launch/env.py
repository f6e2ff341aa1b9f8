"""Where was this process launched? torchelastic (torchrun) > a SLURM srun task > a single process.

Every source is a table of environment variable names, so the contract is readable in one place:

- torchelastic / torchrun, and launchers that speak its contract (DeepSpeed's): RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. It wins over SLURM because `srun torchrun ...` sets both, and then
  SLURM's variables describe the torchrun agent (one per node), not the worker.
- a task of an srun step (SLURM_STEP_ID is set; a batch script's own shell has none): SLURM_PROCID, SLURM_LOCALID,
  SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID, SLURM_STEP_NODELIST (each with the job-level
  fallback). MASTER_ADDR is the first host of the node list; MASTER_PORT is `slurm_port(SLURM_JOB_ID)` =
  20000 + (job id mod 10000): the same on every task without any exchange, below Linux's ephemeral range
  (32768+), and different for jobs sharing a node unless their ids differ by a multiple of 10000. MASTER_ADDR or
  MASTER_PORT already in the environment (exported in the batch script) win over the derived values.
- otherwise one process: rank 0 of 1 on 127.0.0.1, MASTER_PORT from the environment or 29500 (torch's default).

Variables that contradict each other (rank >= world size, tasks per node that do not add up, an srun-less batch
shell that asks for several tasks) raise LaunchEnvError naming the variable. Standard library only: no torch.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.errors import ConfigError

TORCHELASTIC = {
    "rank": ("RANK",),
    "local_rank": ("LOCAL_RANK",),
    "world_size": ("WORLD_SIZE",),
    "local_world_size": ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"),  # LOCAL_SIZE: DeepSpeed's launcher
    "master_addr": ("MASTER_ADDR",),
    "master_port": ("MASTER_PORT",),
}
TORCHELASTIC_MARKERS = ("TORCHELASTIC_RUN_ID", "RANK")

# In each tuple the step's variable comes first: srun may run fewer tasks than the job has.
SLURM = {
    "rank": ("SLURM_PROCID",),
    "local_rank": ("SLURM_LOCALID",),
    "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
    "tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    "node_id": ("SLURM_NODEID",),
    "nodelist": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
}
SLURM_STEP_MARKER = "SLURM_STEP_ID"

SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000
DEFAULT_PORT = 29500


class LaunchEnvError(ConfigError):
    """The launch environment contradicts itself; `field` names the variable at fault."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchelastic" (torchrun), "env" (same variables, another launcher), "slurm", "single"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _get(environ: Mapping[str, str], names: tuple[str, ...], *, required: bool = True) -> tuple[str, str | None]:
    """(name that was found, its value); for a missing one the first name and None."""
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    if required:
        raise LaunchEnvError(names[0], "not set", "the launcher must set it together with the other variables "
                                                  "of its contract; set it or unset the partial set")
    return names[0], None


def _int(environ, names, *, minimum: int = 0, required: bool = True) -> tuple[str, int | None]:
    name, value = _get(environ, names, required=required)
    if value is None:
        return name, None
    try:
        number = int(value)
    except ValueError:
        raise LaunchEnvError(name, f"{value!r} is not an integer", "the launcher sets it to a whole number") from None
    if number < minimum:
        raise LaunchEnvError(name, f"{number} is below {minimum}", "check how the processes were launched")
    return name, number


def _port(name: str, value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise LaunchEnvError(name, f"{value!r} is not a TCP port", "use a number from 1 to 65535")
    return port


def _check_ranks(rank, local_rank, world, local_world, names) -> None:
    (rank_n, local_n, world_n, local_world_n) = names
    if rank >= world:
        raise LaunchEnvError(rank_n, f"{rank} is not below {world_n}={world}", "ranks run from 0 to world size - 1")
    if local_rank >= local_world:
        raise LaunchEnvError(local_n, f"{local_rank} is not below {local_world_n}={local_world}",
                             "local ranks run from 0 to the processes on this node - 1")
    if local_world > world:
        raise LaunchEnvError(local_world_n, f"{local_world} processes on this node exceed {world_n}={world}",
                             "the node cannot hold more processes than the whole job")


# -- SLURM's compressed lists ------------------------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: 'a[1,3],b' -> ['a[1,3]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_ranges(body: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']: a range keeps the zero padding of its lower bound."""
    out = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's host list syntax, as `scontrol show hostnames` prints it: 'gpu[01-02],login' ->
    ['gpu01', 'gpu02', 'login']. Several bracket groups in one name multiply out, left to right."""
    hosts: list[str] = []
    for item in _split_top(nodelist):
        names = [""]
        for text, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if text == "" and body == "":
                continue
            names = [n + text for n in names]
            if body:
                names = [n + part for n in names for part in _expand_ranges(body)]
        hosts.extend(names)
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(f"bad item {item!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_port(job_id: int) -> int:
    """The rendezvous port every task of SLURM job `job_id` derives alone (see the module docstring)."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


# -- the three sources -------------------------------------------------------------------------------------------
def _from_torchelastic(environ: Mapping[str, str]) -> LaunchEnv:
    t = TORCHELASTIC
    rank_n, rank = _int(environ, t["rank"])
    local_n, local_rank = _int(environ, t["local_rank"])
    world_n, world = _int(environ, t["world_size"], minimum=1)
    local_world_n, local_world = _int(environ, t["local_world_size"], minimum=1)
    _check_ranks(rank, local_rank, world, local_world, (rank_n, local_n, world_n, local_world_n))
    _, addr = _get(environ, t["master_addr"])
    port_n, port = _get(environ, t["master_port"])
    source = "torchelastic" if environ.get("TORCHELASTIC_RUN_ID") else "env"
    return LaunchEnv(rank, local_rank, world, local_world, addr, _port(port_n, port), source)


def _from_slurm(environ: Mapping[str, str]) -> LaunchEnv:
    s = SLURM
    rank_n, rank = _int(environ, s["rank"])
    local_n, local_rank = _int(environ, s["local_rank"])
    world_n, world = _int(environ, s["world_size"], minimum=1)
    node_n, node_id = _int(environ, s["node_id"])
    tpn_n, tpn_text = _get(environ, s["tasks_per_node"])
    list_n, nodelist = _get(environ, s["nodelist"])
    job_n, job_id = _int(environ, s["job_id"])
    try:
        per_node = expand_tasks_per_node(tpn_text)
    except ValueError as exc:
        raise LaunchEnvError(tpn_n, f"{tpn_text!r} cannot be read ({exc})", "expected counts like '2(x3),1'") from None
    try:
        hosts = expand_nodelist(nodelist)
    except ValueError as exc:
        raise LaunchEnvError(list_n, f"{nodelist!r} cannot be read ({exc})", "expected a list like 'node[01-04]'") \
            from None
    if sum(per_node) != world:
        raise LaunchEnvError(tpn_n, f"{tpn_text!r} adds up to {sum(per_node)} tasks but {world_n}={world}",
                             "both come from the same srun; do not set them by hand")
    if len(per_node) != len(hosts):
        raise LaunchEnvError(list_n, f"{nodelist!r} has {len(hosts)} hosts but {tpn_n}={tpn_text!r} "
                                     f"describes {len(per_node)} nodes", "both come from the same srun")
    if node_id >= len(per_node):
        raise LaunchEnvError(node_n, f"{node_id} is not below the {len(per_node)} nodes of {list_n}",
                             "node ids run from 0 to the number of nodes - 1")
    local_world = per_node[node_id]
    _check_ranks(rank, local_rank, world, local_world, (rank_n, local_n, world_n, f"{tpn_n}[{node_n}]"))
    addr = environ.get("MASTER_ADDR") or hosts[0]
    port = _port("MASTER_PORT", environ["MASTER_PORT"]) if environ.get("MASTER_PORT") else slurm_port(job_id)
    return LaunchEnv(rank, local_rank, world, local_world, addr, port, "slurm")


def _single(environ: Mapping[str, str]) -> LaunchEnv:
    ntasks = environ.get("SLURM_NTASKS")
    if environ.get("SLURM_JOB_ID") and ntasks and ntasks.strip().isdigit() and int(ntasks) > 1:
        raise LaunchEnvError("SLURM_NTASKS", f"the job asks for {ntasks} tasks but this process is not an srun "
                                             f"task (no {SLURM_STEP_MARKER})",
                             "start the worker with `srun python -m launcher.worker ...` or through torchrun")
    port = _port("MASTER_PORT", environ["MASTER_PORT"]) if environ.get("MASTER_PORT") else DEFAULT_PORT
    return LaunchEnv(0, 0, 1, 1, environ.get("MASTER_ADDR") or "127.0.0.1", port, "single")


def detect(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """The launch environment of this process; raises LaunchEnvError when its variables contradict each other."""
    if any(environ.get(name) for name in TORCHELASTIC_MARKERS):
        return _from_torchelastic(environ)
    if environ.get(SLURM_STEP_MARKER) is not None and environ.get("SLURM_PROCID") is not None:
        return _from_slurm(environ)
    return _single(environ)


def as_torch_env(env: LaunchEnv) -> dict[str, str]:
    """The torchelastic variables for `env`: set them before init_process_group(init_method='env://') so every
    source looks the same to torch."""
    return {"RANK": str(env.rank), "LOCAL_RANK": str(env.local_rank), "WORLD_SIZE": str(env.world_size),
            "LOCAL_WORLD_SIZE": str(env.local_world_size), "MASTER_ADDR": env.master_addr,
            "MASTER_PORT": str(env.master_port)}


# -- which device a worker trains on -----------------------------------------------------------------------------
# Variables that mean srun bound GPUs to each task (--gpus-per-task, --gpu-bind): a task then sees its own GPUs
# only, numbered from 0, whatever its local rank.
SLURM_GPU_BINDING = ("SLURM_GPUS_PER_TASK", "SLURM_GPU_BIND")


def _visible(environ: Mapping[str, str], cuda_count: int) -> str:
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    return f"{cuda_count} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else "")


NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one entry per GPU the NVIDIA driver manages
ROCM_DEVICE = "/dev/kfd"  # present where AMD's driver is: torch.cuda then means ROCm, which only torch can count


def gpus_without_torch(environ: Mapping[str, str] = os.environ, nvidia_gpus: str = NVIDIA_GPUS,
                       rocm_device: str = ROCM_DEVICE) -> int | None:
    """The GPUs torch.cuda would see, read from the driver and CUDA_VISIBLE_DEVICES without importing torch (the
    login-node path of `accum-sched run`); None when only torch can tell (ROCm, GPUs named by UUID or MIG id).

    0 for certain when CUDA_VISIBLE_DEVICES hides every device ('' or a first entry that is not a device) or when
    no GPU driver is present. Otherwise the driver's count, cut as CUDA does: the listed indices up to the first
    one that is not a device. (A CPU-only torch on a GPU machine sees none: a caller that needs that certainty, as
    auto and nccl do, asks torch when this returns more than 0.)"""
    try:
        driver = len(os.listdir(nvidia_gpus))
    except OSError:
        driver = 0
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        entries = [e.strip() for e in cvd.split(",")]
        if not entries[0] or entries[0].startswith("-"):
            return 0
    if driver == 0:
        return None if os.path.exists(rocm_device) else 0
    if cvd is None:
        return driver
    count, seen = 0, set()
    for entry in entries:
        if not entry.isdigit():
            if entry.startswith(("GPU-", "MIG-")):
                return None
            break
        if int(entry) in seen:
            return None  # CUDA's handling of a repeated index is its own
        if int(entry) >= driver:
            break
        seen.add(int(entry))
        count += 1
    return count


def check_devices(process_group: str, nproc_per_node: int, cuda_count: int,
                  environ: Mapping[str, str] = os.environ) -> str | None:
    """Before launch on the node that starts the workers (`accum-sched run`): ConfigError for a setting that cannot
    work with the `cuda_count` GPUs this process sees (torch.cuda.device_count(), which honours
    CUDA_VISIBLE_DEVICES); returns a warning to print, or None."""
    if process_group == "nccl" and cuda_count == 0:
        raise ConfigError("distributed.process_group", "is 'nccl' but CUDA is not available here (no GPU visible, "
                                                       "or a CPU-only torch)",
                          "use process_group: auto (NCCL with GPUs, gloo without) or gloo, or run on a GPU node")
    if process_group != "gloo" and cuda_count and nproc_per_node > cuda_count:
        raise ConfigError("distributed.nproc_per_node", f"{nproc_per_node} workers per node but only "
                                                        f"{_visible(environ, cuda_count)}",
                          f"one worker per GPU: set --nproc-per-node {cuda_count} (or fewer), or make more GPUs "
                          f"visible")
    if process_group == "gloo" and cuda_count:
        return (f"warning: distributed.process_group: 'gloo' on a machine with {_visible(environ, cuda_count)}: "
                f"the workers train on CPU; use auto or nccl to train on the GPUs")
    return None


def cuda_index(local_rank: int, local_world_size: int, cuda_count: int, source: str,
               environ: Mapping[str, str] = os.environ) -> int:
    """The CUDA device (as this process numbers them) for the worker with `local_rank` of `local_world_size` on
    its node, seeing `cuda_count` devices; `source` is LaunchEnv.source. A pure function of its arguments.

    - An srun task bound to its own GPUs (SLURM_GPUS_PER_TASK or SLURM_GPU_BIND set, or one GPU visible to each of
      several tasks, as --gpus-per-task=1 leaves it) uses its first visible device: cuda:0.
    - Otherwise every worker of the node sees every GPU of the node and takes cuda:<local rank>.
    Under torchrun SLURM's variables describe the agent, so binding is read only for srun tasks (source "slurm").
    """
    if cuda_count < 1:
        raise ConfigError("distributed.process_group", "CUDA was chosen but no GPU is visible",
                          "use process_group: gloo or auto on a machine without GPUs")
    if source == "slurm" and local_world_size > 1:
        bound = any(environ.get(name) for name in SLURM_GPU_BINDING)
        if bound or cuda_count == 1:
            return 0
    if local_rank < cuda_count:
        return local_rank
    raise ConfigError("distributed.nproc_per_node", f"local rank {local_rank} of {local_world_size} workers on this "
                                                    f"node but only {_visible(environ, cuda_count)}",
                      "start one worker per visible GPU, or bind one GPU to each task (srun --gpus-per-task=1)")


def choose_device(process_group: str, cuda_count: int, launch: LaunchEnv,
                  environ: Mapping[str, str] = os.environ) -> tuple[str, int | None]:
    """("cuda", index) or ("cpu", None) for this worker: gloo trains on CPU, auto uses CUDA when there is a GPU,
    nccl requires one (ConfigError without)."""
    if process_group == "gloo":
        return "cpu", None
    if cuda_count == 0:
        check_devices(process_group, 1, 0, environ)  # nccl without CUDA: the same error as before launch
        return "cpu", None
    return "cuda", cuda_index(launch.local_rank, launch.local_world_size, cuda_count, launch.source, environ)
