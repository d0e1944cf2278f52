"""Spot preemption on a `ray.cluster_utils.Cluster`: Ray drains a node with the reason
"preemption" and a deadline (what the autoscaler and cloud integrations do when a spot node
is reclaimed with notice). The run checkpoints at the next step boundary and moves off the
node before the deadline, so no step is trained twice; with a notice too short for that, the
node dies first and the normal recovery path takes over.

Ray never kills a drained node at its deadline; the caller does (here, the test)."""

from __future__ import annotations

import json
import time

import pytest
from ray._raylet import GcsClient
from ray.core.generated.autoscaler_pb2 import DRAIN_NODE_REASON_PREEMPTION

import rayhybrid
from benchmarks.clusters import add_node, local_cluster, lose_power
from tests.test_recovery import events, in_background, losses, when_step
from tests.test_wallclock import adds_up

pytestmark = pytest.mark.slow

# One replica per node (a rank takes a node's 2 CPUs): dp2 on two of the three nodes.
COMMON = [
    "+topology=dp2",
    "cluster.cpus_per_rank=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "data.seq_len=32",
    # No periodic checkpoint: the preemption's own is the one restored (and the last step's).
    "checkpoint.every=1000",
    # Long enough that the drain, at step 5, is seen (polled once a second) well before the
    # end, however fast the steps are (0.02 s each on a quiet 2-core machine).
    "train.steps=200",
]


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(head_cpus=0, node_cpus=[2, 2, 2]) as (c, _):
        yield c


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    assert rayhybrid.train(COMMON, run_dir=run_dir)["status"] == "completed"
    return losses(run_dir)


def drain(cluster, node_id: str, deadline_s: float) -> None:
    deadline_ms = int((time.time() + deadline_s) * 1000)
    accepted, why = GcsClient(address=cluster.address).drain_node(
        node_id, DRAIN_NODE_REASON_PREEMPTION, "spot instance reclaimed", deadline_ms
    )
    assert accepted, why


def node_of_replica(run_dir, dp: int) -> str:
    return next(w["node_id"] for w in json.loads((run_dir / "workers.json").read_text()) if w["dp"] == dp)


def test_notice_with_time_to_spare_loses_no_step(cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    thread, result = in_background(COMMON, run_dir)
    when_step(run_dir, 5)
    victim = node_of_replica(run_dir, 1)
    drain(cluster, victim, deadline_s=90)
    thread.join(timeout=400)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["restarts"] == 0
    (notice,) = summary["preemptions"]
    assert notice["node"] == victim and 0 < notice["deadline_s"] <= 90 and notice["lost_steps"] == 0
    # The checkpoint of the step it stopped at, restored on the spare node: each step once.
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [notice["saved_step"], 200]
    assert notice["saved_step"] >= 5
    assert [e["step"] for e in events(run_dir, "resume")] == [notice["saved_step"]]
    assert victim not in {w["node_id"] for w in summary["placement"]}
    assert losses(run_dir) == reference  # each step exactly once (losses() checks), bitwise
    seconds = adds_up(summary)  # goodput: moving off the node is preemption drain, none redone
    assert seconds["preemption_drain"] > 0 and seconds["redone"] == 0 and seconds["detection"] == 0
    (gone,) = [n for n in cluster.list_all_nodes() if n.node_id == victim]
    cluster.remove_node(gone)  # the deadline's end, done by the caller
    add_node(cluster, 2)


def test_notice_too_short_takes_the_recovery_path(cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    thread, result = in_background(COMMON, run_dir)
    when_step(run_dir, 5)
    before = json.loads((run_dir / "workers.json").read_text())
    victim = node_of_replica(run_dir, 1)
    drain(cluster, victim, deadline_s=0.5)
    (gone,) = [n for n in cluster.list_all_nodes() if n.node_id == victim]
    cluster.remove_node(gone, allow_graceful=False)  # reclaimed before a save could finish
    lose_power(before, victim)
    thread.join(timeout=400)
    add_node(cluster, 2)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert losses(run_dir) == reference


def test_elastic_run_shrinks_off_the_draining_node(cluster, reference, tmp_path):
    """An elastic run does not wait for room elsewhere: it checkpoints, goes on with the
    replica on the healthy node, and its moved replica's placement group waits for a node."""
    run_dir = tmp_path / "run"
    elastic = ["elastic.enabled=true", "elastic.min_dp=1", "elastic.max_dp=2"]
    thread, result = in_background([*COMMON, *elastic], run_dir)
    when_step(run_dir, 5)
    victim = node_of_replica(run_dir, 1)
    drain(cluster, victim, deadline_s=90)
    thread.join(timeout=400)
    (gone,) = [n for n in cluster.list_all_nodes() if n.node_id == victim]
    cluster.remove_node(gone)
    add_node(cluster, 2)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["restarts"] == 0
    (notice,) = summary["preemptions"]
    assert notice["lost_steps"] == 0
    shrink = summary["resizes"][0]
    assert (shrink["from_dp"], shrink["to_dp"]) == (2, 1) and "preempted" in shrink["cause"]
    assert shrink["step"] == notice["saved_step"]
    seconds = adds_up(summary)  # goodput: the resize's phases, the rest of the move preemption drain
    assert seconds["preemption_drain"] > 0 and seconds["worker_init"] > 0 and seconds["redone"] == 0
    assert losses(run_dir) == pytest.approx(reference, rel=1e-5)  # each step once; dp 2 then 1
