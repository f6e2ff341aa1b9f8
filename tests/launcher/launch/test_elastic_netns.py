"""Elastic runs across real hosts (issue 38, docs/elastic.md): two `accum-sched run --nnodes 1:2` agents, each on
its own network-namespace node (tests/netns_nodes.py: its own address and host name), the rendezvous endpoint on
node 1's address, both writing one output directory on the host's file system, so the lock, the metrics and the
checkpoints are shared across "hosts" as on a shared file system. Node 2's agent is SIGKILLed (its process group)
mid-run; node 1's agent re-forms the group alone, resumes from the newest checkpoint with the factor doubled and
finishes allclose to the same plain-torch reference as the loopback kill test (test_elastic_run.py, whose config,
agents and reference this file reuses).

Needs root (the namespaces); elsewhere it skips with the reason, except where the SLURM tests are required
(slurm_required(): root with SLURM or apt-get, or ACCUM_SCHED_REQUIRE_SLURM=1), where a node that cannot be made is
a failure, as for the SLURM fixture's nodes.
"""
from __future__ import annotations

import os
import time

import pytest
from test_elastic_run import DEADLINE_S, Agents, finished_like_the_reference, lose_b_and_finish, two_agents_past

from netns_nodes import NetnsNodes, NetnsUnavailable
from slurm_cluster import slurm_required

NODE = {"a": "elnode1", "b": "elnode2"}  # agent a on node 1 (the rendezvous store's host), b on node 2

NODES = ["elnode1", "elnode2"]


@pytest.fixture
def nodes(tmp_path):
    net = NetnsNodes(tmp_path / "net", NODES)
    os.makedirs(net.root, exist_ok=True)
    try:
        net.start()
    except NetnsUnavailable as why:
        net.stop()
        required, because = slurm_required()
        if required:
            pytest.fail(f"network-namespace nodes required here ({because}) but unavailable: {why} "
                        f"(ACCUM_SCHED_REQUIRE_SLURM=0 skips them instead)")
        pytest.skip(f"network-namespace nodes unavailable: {why} (not required: {because})")
    try:
        yield net
    finally:
        net.stop()  # kills whatever is still inside the namespaces, removes them and the bridge


@pytest.mark.slow
def test_a_killed_host_leaves_the_other_host_to_finish_exactly(tmp_path, nodes):
    agents = Agents(str(tmp_path), "1:2")
    agents.host = nodes.addr["elnode1"]  # the store's host: node 1's own address, reached from node 2 over the bridge
    deadline = time.monotonic() + DEADLINE_S
    try:
        two_agents_past(agents, 5, deadline, wrap=lambda name: (lambda argv: nodes.wrap(NODE[name], argv)))
        reformed = lose_b_and_finish(agents, deadline)
    finally:
        agents.close()
    metrics = finished_like_the_reference(agents, world=1)
    factors = [m["factor"] for m in metrics]
    assert 3 in factors and factors[-1] == 6, factors  # 2 workers on 2 hosts, then 1 with the factor doubled
    with open(os.path.join(agents.run, ".accum-sched.lock")) as f:  # the shared lock's holder, as node 1 wrote it
        holder = f.read()  # the job is keyed on node 1's endpoint, and its first agent ran as host elnode1
    assert holder.startswith(f"elastic job {agents.host}:{agents.port} ") and " on elnode1 since " in holder, holder
    print(f"SIGKILL on node 2 to the first step of node 1's re-formed group: {reformed:.1f} s")
