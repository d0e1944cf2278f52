"""A node of a `ray.cluster_utils.Cluster` disappears mid-run: the driver notices the dead
actors, places the group again on the nodes that are left, restores the latest checkpoint and
finishes with the same losses."""

from __future__ import annotations

import json
import time

import pytest

import rayhybrid
from tests.clusters import local_cluster
from tests.test_recovery import COMMON, in_background, losses, when_step


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(head_cpus=0, node_cpus=[2, 2]) as (c, nodes):
        yield c, nodes


def test_node_removed_mid_run(cluster, tmp_path):
    c, nodes = cluster
    run_dir = tmp_path / "run"
    ref = rayhybrid.train([*COMMON, "+topology=dp2", "train.steps=9"], run_dir=tmp_path / "ref")
    thread, result = in_background([*COMMON, "+topology=dp2", "train.steps=9"], run_dir)
    when_step(run_dir, 4)
    before = json.loads((run_dir / "workers.json").read_text())
    node_of_rank0 = before[0]["node_id"]
    lost = [w["rank"] for w in before if w["node_id"] == node_of_rank0]
    (victim,) = [n for n in nodes if n.node_id == node_of_rank0]
    removed_at = time.monotonic()
    c.remove_node(victim)
    thread.join(timeout=400)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["restarts"] >= 1
    assert time.monotonic() - removed_at < 300
    assert all(p["node_id"] != node_of_rank0 for p in summary["placement"])  # placed on what is left
    # The ranks on the lost node were replaced (Ray placed their bundles again); the others kept.
    assert summary["recoveries"][0]["replaced_ranks"] == lost
    assert losses(run_dir) == pytest.approx(losses(tmp_path / "ref"), rel=1e-5)
    assert ref["status"] == "completed"
