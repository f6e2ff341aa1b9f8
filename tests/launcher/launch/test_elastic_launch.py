"""The launch side of an elastic run (docs/elastic.md), without starting one: distributed.nnodes "MIN:MAX", the
torchrun command, the output directory shared by the agents of one job, and the refusals before launch (one line
naming the field, exit 2, nothing written)."""
from __future__ import annotations

import os

import pytest

from launcher import cli
from launcher.checkpoint import resume
from launcher.config import load_config
from launcher.errors import ConfigError
from launcher.launch import rundir, torchrun

CONFIG = """\
run: {{output_dir: {out}, seed: 0, epochs: 1}}
task: {{target: builtin:regression, args: {{samples: 256}}}}
data: {{micro_batch_size: 8}}
accumulation: {{global_batch: 96}}
optimizer: {{name: sgd, lr: 0.01}}
distributed: {{backend: ddp, nproc_per_node: 1, nnodes: {nodes}}}
"""


def write(tmp_path, nodes='"1:3"', out=None):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(out=out or tmp_path / "out", nodes=nodes))
    return str(path)


def test_nnodes_takes_a_number_or_a_quoted_range(tmp_path):
    cfg = load_config(write(tmp_path))
    assert cfg.distributed.elastic and cfg.distributed.node_range == (1, 3)
    assert cfg.world_size == 3  # the checks before launch take the largest group
    plain = load_config(write(tmp_path, nodes="2"))
    assert not plain.distributed.elastic and plain.distributed.node_range == (2, 2) and plain.world_size == 2
    # the --nnodes flag quotes a range: YAML would read 1:3 as the base-60 int 63
    assert load_config(write(tmp_path, nodes="1"), ['distributed.nnodes="2:4"']).distributed.node_range == (2, 4)


@pytest.mark.parametrize("nodes, says", [
    ('"3:1"', "'3:1' needs 1 <= MIN <= MAX, got 3 and 1"),
    ('"0:2"', "'0:2' needs 1 <= MIN <= MAX, got 0 and 2"),
    ('"2"', "'2' is neither a number of nodes nor \"MIN:MAX\""),
    ('"a:b"', "'a:b' is neither a number of nodes nor \"MIN:MAX\""),
    ("0", "0 needs 1 <= MIN <= MAX, got 0 and 0"),
])
def test_a_bad_nnodes_is_one_line_naming_the_field(tmp_path, nodes, says):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, nodes=nodes))
    assert info.value.line() == (f"distributed.nnodes: {says}; a number of nodes, or \"MIN:MAX\" (quoted) for an "
                                 "elastic run, e.g. \"1:4\"")


def test_the_torchrun_command_of_an_elastic_agent():
    plan = torchrun.LaunchPlan(nproc_per_node=1, nnodes="1:3", rdzv_endpoint="node01:29400", rdzv_id="accum-x",
                               max_restarts=3, rdzv_conf="last_call_timeout=5")
    argv = torchrun.torchrun_argv(plan, ["--config", "c.yaml"], python="py")
    assert argv == ["py", "-m", "torch.distributed.run", "--nproc-per-node", "1", "--nnodes", "1:3",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "node01:29400", "--rdzv-id", "accum-x",
                    "--rdzv-conf", "last_call_timeout=5", "--signals-to-handle", "SIGTERM,SIGHUP,SIGQUIT",
                    "--max-restarts", "3", "-m", "launcher.worker", "--config", "c.yaml"]
    env = torchrun.elastic_env({"A": "1"})
    assert env == {"A": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", resume.ELASTIC_ENV: "1"}
    assert torchrun.ELASTIC_ENV == resume.ELASTIC_ENV  # one name on both sides (no import between the layers)


def test_agents_of_one_job_share_the_directory_and_others_are_refused(tmp_path):
    out = str(tmp_path / "out")
    first, is_first = rundir.hold_elastic(out, "h:1 accum-a")
    rundir._HELD.clear()  # as another process would: a lock of its own on the same file
    second, second_first = rundir.hold_elastic(out, "h:1 accum-a")
    rundir._HELD.clear()
    try:
        assert is_first and not second_first  # the first agent starts the run, the second joins it
        with pytest.raises(ConfigError, match=r"is in use by another elastic job \(h:1 accum-a\); give this agent "
                                              r"the same --rdzv-endpoint"):
            rundir.hold_elastic(out, "h:2 accum-b")
        with pytest.raises(ConfigError, match=r"is in use by another `accum-sched run` \(elastic job h:1 accum-a, "
                                              r"first agent pid \d+ on "):
            rundir.hold(out)  # a plain run wants the directory alone
    finally:
        os.close(first)
        os.close(second)
    rundir._HELD.clear()
    fd = rundir.hold(out)  # free once every agent ended
    rundir.release(fd)
    _, again = rundir.hold_elastic(out, "h:2 accum-b")  # a later job starts afresh
    rundir.release_all()
    assert again


@pytest.mark.parametrize("args, says", [
    ([], "error: --rdzv-endpoint: is required for an elastic run (distributed.nnodes '1:3'); give HOST:PORT of a "
         "node that stays for the whole run, the same on every node"),
    (["--rdzv-endpoint", "127.0.0.1:29400", "--node-rank", "1"],
     "error: --node-rank: is not used by an elastic run: the rendezvous numbers the nodes; leave --node-rank out"),
    (["--rdzv-endpoint", "127.0.0.1:29400", "--resume", "somewhere"],
     "error: --resume: 'somewhere': an elastic run continues from the newest checkpoint of its directory, every "
     "time its group re-forms; use --resume auto, or none"),
])
def test_an_elastic_run_refuses_before_launch_in_one_line(tmp_path, capsys, args, says):
    assert cli.main(["run", write(tmp_path), *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [says]
    assert not (tmp_path / "out").exists()  # nothing launched, nothing written


def test_the_nnodes_flag_makes_a_run_elastic(tmp_path, capsys):
    assert cli.main(["run", write(tmp_path, nodes="1"), "--nnodes", "2:3"]) == 2
    assert capsys.readouterr().err.startswith("error: --rdzv-endpoint: is required for an elastic run "
                                              "(distributed.nnodes '2:3')")


def test_slurm_refuses_an_elastic_range_in_one_line(tmp_path, capsys):
    assert cli.main(["slurm", write(tmp_path), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: distributed.nnodes: '1:3' is an elastic range; `accum-sched slurm` submits a fixed number of nodes; "
        "give a number of nodes here, or start `accum-sched run --nnodes MIN:MAX` on each node of an allocation "
        "(docs/elastic.md)"]


def test_resume_auto_of_an_elastic_run_checks_the_config_before_launch(tmp_path, capsys):
    from launcher.checkpoint import store
    from launcher.checkpoint.manifest import Manifest

    cfg_path = write(tmp_path)
    other = load_config(cfg_path, ["optimizer.lr=0.5"])  # the checkpoint's run had another learning rate
    root = store.checkpoint_root(other)
    final = store.step_dir(root, 4)
    os.makedirs(final + ".tmp")
    with open(os.path.join(final + ".tmp", store.STATE), "wb") as f:
        f.write(b"abc")
    store.commit(final + ".tmp", final, Manifest(step=4, epoch=0, micro_batch=8, batches_per_epoch=32,
                                                 world_size=2, micro_batch_size=8,
                                                 config_hash=store.config_hash(other),
                                                 config=store.training_config(other), reason="step"))
    port = torchrun._free_port(2, ("127.0.0.1", 0))
    args = ["run", cfg_path, "--rdzv-endpoint", f"127.0.0.1:{port}", "--resume", "auto", "--max-restarts", "1"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: optimizer.lr: is 0.01 but checkpoint {final} was made with 0.5; resume with the config "
                   "the run was started with, or set checkpoint.force_resume: true (--set "
                   "checkpoint.force_resume=true) to load it anyway"]
    assert os.listdir(root) == ["step-00000004"] and not os.path.exists(tmp_path / "out" / "config.yaml")
    assert rundir.held() == ()
