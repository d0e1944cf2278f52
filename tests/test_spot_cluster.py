"""Spot notices on a 3-node `ray.cluster_utils.Cluster`, end to end: every node has its own fake
metadata server on 127.0.0.1 (the node's environment names it, as a cloud VM's link-local
address would), speaking AWS's IMDSv2 or GCP's metadata format (tests/test_spot.py checks the
formats). When the server of the node of replica 1 posts a notice, that node's watcher asks Ray
to drain it with the notice's deadline, and the run checkpoints the step it is at and moves to
the spare node: no step lost or trained twice, the losses those of an uninterrupted run. No
request ever leaves the machine."""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
import ray
from ray.cluster_utils import Cluster

import rayhybrid
from benchmarks.clusters import HEALTH_CHECKS
from rayhybrid.cluster.spot import AWS_URL_ENV, GCP_URL_ENV
from tests.test_recovery import events, in_background, losses, when_step
from tests.test_spot import closed_url, serving

pytestmark = pytest.mark.slow

COMMON = [
    "+topology=dp2",
    "cluster.cpus_per_rank=2",
    "cluster.spot_poll_s=0.2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "data.seq_len=32",
    "checkpoint.every=1000",
    "train.steps=150",
]


@contextlib.contextmanager
def cloud_cluster(cloud: str):
    """Three 2-CPU nodes, each with a fake metadata server of `cloud` of its own; the driver
    (this process) sees one too, so the run looks for notices. Yields the fakes by node id."""
    env_name, other = (AWS_URL_ENV, GCP_URL_ENV) if cloud == "aws" else (GCP_URL_ENV, AWS_URL_ENV)
    with contextlib.ExitStack() as stack:
        fakes = [stack.enter_context(serving(cloud)) for _ in range(4)]
        before = {k: os.environ.get(k) for k in (env_name, other)}
        os.environ[env_name], os.environ[other] = fakes[3].url, closed_url()
        system = {"enable_metrics_collection": False, **HEALTH_CHECKS}
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": system}
        )
        try:
            env = [{env_name: fake.url, other: closed_url()} for fake in fakes[:3]]
            nodes = [cluster.add_node(num_cpus=2, include_dashboard=False, env_vars=e) for e in env]
            cluster.wait_for_nodes()
            ray.init(address=cluster.address)
            yield {node.node_id: fake for node, fake in zip(nodes, fakes)}
        finally:
            ray.shutdown()
            cluster.shutdown()
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_a_cloud_notice_drains_the_node_and_the_run_moves_with_no_lost_step(cloud, tmp_path):
    with cloud_cluster(cloud) as fakes:
        reference = rayhybrid.train([*COMMON, "cluster.spot_notices=false"], run_dir=tmp_path / "ref")
        run_dir = tmp_path / "run"
        thread, result = in_background(COMMON, run_dir)
        when_step(run_dir, 5)
        workers = json.loads((run_dir / "workers.json").read_text())
        victim = next(w["node_id"] for w in workers if w["dp"] == 1)
        fake = fakes[victim]
        fake.deadline = int(time.time()) + 120  # AWS: two minutes ahead (GCP: 30 s, by the watcher)
        fake.notice_after = fake.polls  # the cloud posts its notice now
        thread.join(timeout=400)
        summary = result.get("summary")
        assert summary is not None, result.get("error")
        assert fake.noticed()
        assert summary["status"] == "completed" and summary["restarts"] == 0
        (notice,) = summary["preemptions"]
        assert notice["node"] == victim and notice["lost_steps"] == 0
        left = notice["deadline_s"]
        assert (100 < left <= 120) if cloud == "aws" else (0 < left <= 30), notice
        assert victim not in {p["node_id"] for p in summary["placement"]}
        assert [e["step"] for e in events(run_dir, "resume")] == [notice["saved_step"]]
        assert losses(run_dir) == losses(tmp_path / "ref") and reference["status"] == "completed"
        # Only the victim's server posted a notice; the others were asked and said no.
        assert all(not f.noticed() and f.polls > 0 for node, f in fakes.items() if node != victim)
