"""launcher.launch.env: which launcher started this process, from environment tables (pure functions, fake env dicts).

The same detection under a real srun is checked in test_slurm_cluster.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.errors import ConfigError
from launcher.launch.env import (
    LaunchEnv,
    LaunchEnvError,
    as_torch_env,
    check_devices,
    choose_device,
    cuda_index,
    detect,
    expand_nodelist,
    expand_tasks_per_node,
    slurm_port,
)

TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node07", "MASTER_PORT": "29400"}
# One task of `srun -N2 -n4` (job 123457, node 1), as SLURM 22.05 sets it.
SRUN = {"SLURM_JOB_ID": "123457", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]"}


def test_torchelastic_wins_over_slurm():
    # srun starting torchrun: SLURM's variables describe the agent (node 0, task 0), torchrun's the worker.
    env = detect({**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", **TORCHRUN})
    assert env == LaunchEnv(3, 1, 4, 2, "node07", 29400, "torchelastic")
    other = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}
    assert detect(other).source == "env"  # DeepSpeed's launcher: same contract, no run id


def test_slurm_ranks_addr_and_port():
    env = detect(SRUN)
    assert env == LaunchEnv(3, 1, 4, 2, "gpu07", slurm_port(123457), "slurm")
    assert env.master_port == 20000 + 3457
    # the step's variables win over the job's (srun may use fewer tasks than the allocation)
    assert detect({**SRUN, "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}).world_size == 4
    # uneven tasks per node: node 1 holds one task
    uneven = {**SRUN, "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_PROCID": "2",
              "SLURM_LOCALID": "0"}
    assert detect(uneven).local_world_size == 1
    # exported MASTER_ADDR / MASTER_PORT win over the derived values
    over = detect({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "12345"})
    assert (over.master_addr, over.master_port) == ("head", 12345)
    # job fallbacks when the step variables are absent
    job_only = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP_") or k == "SLURM_STEP_ID"}
    assert detect(job_only) == env


def test_single_process_and_batch_shell():
    assert detect({}) == LaunchEnv(0, 0, 1, 1, "127.0.0.1", 29500, "single")
    # a batch script's own shell has SLURM_PROCID but no SLURM_STEP_ID: not an srun task
    assert detect({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).source == "single"
    with pytest.raises(LaunchEnvError, match=r"^SLURM_NTASKS: .*not an srun task.*; start the worker with `srun"):
        detect({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize("change, field, problem", [
    ({"RANK": "4"}, "RANK", "4 is not below WORLD_SIZE=4"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK", "2 is not below LOCAL_WORLD_SIZE=2"),
    ({"LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE", "5 processes on this node exceed WORLD_SIZE=4"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE", "0 is below 1"),
    ({"RANK": "x"}, "RANK", "'x' is not an integer"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT", "'70000' is not a TCP port"),
    ({"MASTER_ADDR": None}, "MASTER_ADDR", "not set"),
    ({"RANK": None}, "RANK", "not set"),  # TORCHELASTIC_RUN_ID alone marks a partial set
])
def test_torchelastic_inconsistent(change, field, problem):
    environ = {k: v for k, v in {**TORCHRUN, **change}.items() if v is not None}
    with pytest.raises(LaunchEnvError) as err:
        detect(environ)
    assert (err.value.field, err.value.problem) == (field, problem)


@pytest.mark.parametrize("change, field, fragment", [
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID", "4 is not below SLURM_STEP_NUM_TASKS=4"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID", "2 is not below SLURM_STEP_TASKS_PER_NODE[SLURM_NODEID]=2"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2,1"}, "SLURM_STEP_TASKS_PER_NODE", "adds up to 3 tasks"),
    ({"SLURM_STEP_NODELIST": "gpu07"}, "SLURM_STEP_NODELIST", "has 1 hosts"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID", "2 is not below the 2 nodes"),
    ({"SLURM_STEP_NODELIST": "gpu[07-08"}, "SLURM_STEP_NODELIST", "cannot be read"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(y2)"}, "SLURM_STEP_TASKS_PER_NODE", "cannot be read"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID", "not set"),
])
def test_slurm_inconsistent(change, field, fragment):
    environ = {k: v for k, v in {**SRUN, **change}.items() if v is not None}
    with pytest.raises(LaunchEnvError) as err:
        detect(environ)
    assert err.value.field == field and fragment in err.value.problem, err.value.line()


def test_nodelist_and_tasks_per_node_syntax():
    assert expand_nodelist("gpu[01-03,7],login,r[1-2]n[08-09]") == [
        "gpu01", "gpu02", "gpu03", "gpu7", "login", "r1n08", "r1n09", "r2n08", "r2n09"]
    assert expand_nodelist("node[098-101]") == ["node098", "node099", "node100", "node101"]
    assert expand_nodelist("vm") == ["vm"]
    for bad in ("a[3-1]", "a[1-2", "a]", "a[x]"):
        with pytest.raises(ValueError):
            expand_nodelist(bad)
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]


def test_as_torch_env_round_trips():
    env = detect(SRUN)
    again = detect({**as_torch_env(env), "TORCHELASTIC_RUN_ID": "x"})
    assert (again.rank, again.local_rank, again.world_size, again.local_world_size, again.master_addr,
            again.master_port) == (env.rank, env.local_rank, env.world_size, env.local_world_size, env.master_addr,
                                   env.master_port)


def test_env_never_imports_torch():
    code = "import sys, launcher.launch.env; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- device mapping: (local rank, workers on the node, GPUs this process sees, launcher, environment) -> cuda index
BOUND = {"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "0"}


@pytest.mark.parametrize("local_rank, local_world, visible, source, environ, index", [
    (3, 8, 8, "torchelastic", {}, 3),  # torchrun: every worker sees the node's 8 GPUs
    (3, 8, 8, "slurm", {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 3),  # srun, --gpus-per-node: no binding
    (3, 8, 1, "slurm", BOUND, 0),  # srun --gpus-per-task=1: each task sees its own GPU as cuda:0
    (3, 8, 1, "slurm", {"CUDA_VISIBLE_DEVICES": "3"}, 0),  # --gpu-bind=single:1 / cgroups: one GPU each
    (1, 4, 2, "slurm", {"SLURM_GPUS_PER_TASK": "2"}, 0),  # two GPUs per task: the first of its own
    (1, 2, 4, "slurm", {"SLURM_GPU_BIND": "map_gpu:0,1"}, 0),  # bound, even though it sees enough GPUs
    (3, 8, 8, "torchelastic", {"SLURM_GPUS_PER_TASK": "8"}, 3),  # torchrun in an srun task: SLURM's is the agent
    (0, 1, 1, "single", {}, 0),
    (1, 2, 2, "env", {"CUDA_VISIBLE_DEVICES": "2,3"}, 1),  # numbering follows what the process sees
])
def test_cuda_index_table(local_rank, local_world, visible, source, environ, index):
    assert cuda_index(local_rank, local_world, visible, source, environ) == index


@pytest.mark.parametrize("local_rank, local_world, visible, source, environ, fragment", [
    (2, 4, 2, "torchelastic", {"CUDA_VISIBLE_DEVICES": "0,1"}, "local rank 2 of 4 workers on this node but only "
                                                                "2 GPU(s) visible (CUDA_VISIBLE_DEVICES=0,1)"),
    (3, 4, 2, "slurm", {}, "local rank 3 of 4 workers"),  # two GPUs shared by four unbound tasks
    (0, 1, 0, "single", {}, "no GPU is visible"),
])
def test_cuda_index_refuses_with_the_field(local_rank, local_world, visible, source, environ, fragment):
    with pytest.raises(ConfigError) as err:
        cuda_index(local_rank, local_world, visible, source, environ)
    assert err.value.field in ("distributed.nproc_per_node", "distributed.process_group")
    assert fragment in err.value.problem, err.value.line()


def test_choose_device_by_process_group():
    one = LaunchEnv(1, 1, 2, 2, "h", 1, "torchelastic")
    assert choose_device("gloo", 2, one, {}) == ("cpu", None)  # gloo trains on CPU, GPUs or not
    assert choose_device("auto", 0, one, {}) == ("cpu", None)
    assert choose_device("auto", 2, one, {}) == ("cuda", 1)
    assert choose_device("nccl", 2, one, {}) == ("cuda", 1)
    with pytest.raises(ConfigError, match=r"^distributed.process_group: is 'nccl' but CUDA is not available"):
        choose_device("nccl", 0, one, {})


@pytest.mark.parametrize("group, nproc, visible, outcome", [
    ("auto", 2, 0, None), ("gloo", 4, 0, None), ("auto", 8, 8, None), ("nccl", 4, 8, None),
    ("nccl", 1, 0, "error: distributed.process_group: is 'nccl' but CUDA is not available"),
    ("auto", 8, 4, "error: distributed.nproc_per_node: 8 workers per node but only 4 GPU(s) visible"),
    ("nccl", 3, 2, "error: distributed.nproc_per_node: 3 workers per node but only 2 GPU(s) visible"),
    ("gloo", 8, 4, "warning: distributed.process_group: 'gloo' on a machine with 4 GPU(s) visible: the workers "
                   "train on CPU"),
])
def test_check_devices_before_launch(group, nproc, visible, outcome):
    try:
        said = check_devices(group, nproc, visible, {})
    except ConfigError as err:
        said = f"error: {err.line()}"
    assert (said is None) if outcome is None else said.startswith(outcome), said
