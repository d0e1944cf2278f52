"""Several Ray nodes on one machine: a `ray.cluster_utils.Cluster` of several raylets, for the
benchmarks that lose a node (and for the tests, which import it from here).

    with local_cluster(head_cpus=0, node_cpus=[2, 2, 2]) as (cluster, nodes):
        ...   # ray is initialised against it; nodes can be removed and added

No dashboard anywhere: its agent takes a whole core of a 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import signal

import ray
from ray.cluster_utils import Cluster

HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 3}


def add_node(cluster: Cluster, num_cpus: int, num_gpus: int | None = None):
    """`num_gpus`: GPUs the node declares to Ray, none of which need exist (Ray hands out their
    ids all the same); None: the GPUs Ray detects."""
    gpus = {} if num_gpus is None else {"num_gpus": num_gpus}
    return cluster.add_node(num_cpus=num_cpus, include_dashboard=False, **gpus)


@contextlib.contextmanager
def local_cluster(head_cpus: int, node_cpus: list[int], node_gpus: int | None = None):
    """`head_cpus=0` keeps ranks off the driver's node, so removing any other node is safe;
    `node_gpus`: the GPUs each added node declares."""
    # No metrics: after a node dies, Ray's metrics export keeps the GCS and the head's
    # dashboard agent busy at a core each, which starves the (niced) ranks on this 2-core
    # machine: steps 20 times slower, long enough to look hung.
    # Health checks as docs/recovery-and-elasticity.md suggests for a real cluster: a node that
    # dies outright is declared dead within seconds (Ray's defaults take about 15 s).
    system = {"enable_metrics_collection": False, **HEALTH_CHECKS}
    head = {"num_cpus": head_cpus, "include_dashboard": False, "_system_config": system}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = [add_node(cluster, cpus, node_gpus) for cpus in node_cpus]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def lose_power(workers: list[dict], node_id: str) -> None:
    """What a machine losing power adds to `remove_node(node, allow_graceful=False)`, which
    kills only the node's raylet: the rank processes on it (`workers.json` entries) die at the
    same moment. On their own they notice the raylet's death only a little later, and a short
    run can finish first."""
    for w in workers:
        if w["node_id"] == node_id:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w["pid"], signal.SIGKILL)
