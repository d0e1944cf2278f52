"""Placement on a two-node `ray.cluster_utils.Cluster`: every tensor-parallel group on one node,
each replica's stages packed, and a clear error when the cluster can never hold the job."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict

import pytest
import ray

import rayhybrid
from benchmarks.clusters import local_cluster
from rayhybrid.cluster.placement import ReplicaShape, can_add_nodes, check_capacity
from rayhybrid.errors import PlacementError
from tests.test_cli import REPO

pytestmark = pytest.mark.slow  # Ray or several processes; see the quick tier in README.md


def fake_nodes(*cpus: int, gpus: int = 0) -> list[dict]:
    return [{"Alive": True, "Resources": {"CPU": float(c), **({"GPU": float(gpus)} if gpus else {})}} for c in cpus]


def test_replica_is_pp_bundles_of_tp_devices():
    shape = ReplicaShape(pp=2, tp=4, use_gpu=True, cpus_per_rank=1)
    assert shape.bundles() == [{"CPU": 4, "GPU": 4}, {"CPU": 4, "GPU": 4}]
    assert ReplicaShape(pp=3, tp=2, use_gpu=False, cpus_per_rank=0.5).bundles() == [{"CPU": 1.0}] * 3


def test_capacity_counts_whole_tp_groups_per_node():
    shape = ReplicaShape(pp=2, tp=2, use_gpu=False, cpus_per_rank=1)
    check_capacity(shape, dp=2, nodes=fake_nodes(4, 4))
    # 9 CPUs in total, more than 8 ranks, but each 3-CPU node holds one 2-rank group only.
    with pytest.raises(PlacementError, match=r"8 ranks .* 8 CPUs .* has 9 on 3 node"):
        check_capacity(shape, dp=2, nodes=fake_nodes(3, 3, 3))


def test_capacity_gpu_and_tp_wider_than_a_node():
    with pytest.raises(PlacementError, match=r"tp=8 needs 8 GPUs on one node but the largest node has 4"):
        check_capacity(ReplicaShape(pp=1, tp=8, use_gpu=True, cpus_per_rank=1), dp=1, nodes=fake_nodes(64, 64, gpus=4))
    with pytest.raises(PlacementError, match=r"32 ranks .* 32 GPUs .* has 16 on 2 node"):
        check_capacity(ReplicaShape(pp=4, tp=4, use_gpu=True, cpus_per_rank=1), dp=2, nodes=fake_nodes(64, 64, gpus=8))


# The autoscaler monitor's reports (`autoscaler_report` in Ray's autoscaling status), as Ray
# 2.60 wrote them: every head runs the monitor, and without an autoscaling config its
# read-only autoscaler names one node type per node after the node's id.
READONLY_REPORT = {
    "active_nodes": {"node_a146816204c49ce4e6b4fd1038bdfc4f32b8bca6a54df50019fa3eed": 1},
    "pending_launches": {},
    "node_type_mapping": {
        "a146816204c49ce4e6b4fd1038bdfc4f32b8bca6a54df50019fa3eed": "node_a146816204c49ce4e6b4fd1038bdfc4f32b8bca6a54df50019fa3eed"
    },
    "legacy": True,
}
FAKE_MULTINODE_REPORT = {  # tests/test_autoscaler.py's head, before it added a node
    "active_nodes": {"ray.head.default": 1},
    "pending_launches": {},
    "node_type_mapping": {"fffffffffffffffffffffffffffffffffffffffffffffffffff00000": "ray.head.default"},
    "legacy": True,
}


def test_only_an_autoscaler_with_node_types_of_its_own_can_add_nodes():
    assert not can_add_nodes(None)  # no report yet
    assert not can_add_nodes(READONLY_REPORT)  # ray start --head, a local Ray, cluster_utils.Cluster
    assert can_add_nodes(FAKE_MULTINODE_REPORT)
    launching = {**READONLY_REPORT, "pending_launches": {"gpu_worker": 2}}
    assert can_add_nodes(launching)


def test_a_ray_this_process_started_is_not_asked_for_an_autoscaler():
    """rayhybrid's own local Ray (or a notebook's ray.init()) has no autoscaler: no wait for the
    head's monitor to report (it reports seconds after the start, up to AUTOSCALER_REPORT_WAIT_S)."""
    probe = (
        "import time, ray\n"
        "from rayhybrid.cluster.placement import autoscaled\n"
        "ray.init(address='local', num_cpus=1, include_dashboard=False, logging_level='ERROR')\n"
        "start = time.monotonic()\n"
        "print('autoscaled', autoscaled(), round(time.monotonic() - start, 2))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    answer, seconds = out.stdout.split()[-2:]
    assert answer == "False" and float(seconds) < 1.0, out.stdout + out.stderr[-3000:]


@pytest.fixture(scope="module")
def two_nodes():
    with local_cluster(head_cpus=4, node_cpus=[4]) as (cluster, _):
        yield cluster


def test_dp2_pp2_tp2_on_two_nodes(two_nodes, tmp_path):
    summary = rayhybrid.train(
        ["+topology=dp2_pp2_tp2", "train.steps=3", f"cluster.address={two_nodes.address}"], run_dir=tmp_path
    )
    assert summary["status"] == "completed" and summary["steps"] == 3
    placement = summary["placement"]
    assert [p["rank"] for p in placement] == list(range(8))
    tp_groups, replicas = defaultdict(set), defaultdict(set)
    for p in placement:
        assert p["rank"] == (p["dp"] * 2 + p["pp"]) * 2 + p["tp"]  # rank order: tp fastest
        assert p["bundle"] == p["pp"]
        tp_groups[p["dp"], p["pp"]].add(p["node_id"])
        replicas[p["dp"]].add(p["node_id"])
    assert all(len(nodes) == 1 for nodes in tp_groups.values()), tp_groups
    # Each 4-CPU node holds exactly one packed replica (both stages), so the replicas differ.
    assert all(len(nodes) == 1 for nodes in replicas.values()), replicas
    assert replicas[0] != replicas[1]
    assert ray.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    ), "placement groups must be released at the end of a run"


def test_more_ranks_than_the_cluster_has(two_nodes, tmp_path):
    with pytest.raises(PlacementError) as info:
        rayhybrid.train(
            ["topology.dp=4", "topology.pp=2", "topology.tp=2", "train.micro_batch_size=2", "train.steps=1"],
            run_dir=tmp_path,
        )
    assert "16 ranks" in str(info.value) and "has 8 on 2 node" in str(info.value)
