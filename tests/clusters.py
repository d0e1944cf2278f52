"""Multi-node tests on one machine: a `ray.cluster_utils.Cluster` of several raylets.

    with local_cluster(head_cpus=0, node_cpus=[2, 2, 2]) as (cluster, nodes):
        ...   # ray is initialised against it; nodes can be removed and added

No dashboard anywhere: its agent takes a whole core of this 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import signal

import ray
from ray.cluster_utils import Cluster


def add_node(cluster: Cluster, num_cpus: int):
    return cluster.add_node(num_cpus=num_cpus, include_dashboard=False)


@contextlib.contextmanager
def local_cluster(head_cpus: int, node_cpus: list[int]):
    """`head_cpus=0` keeps ranks off the driver's node, so removing any other node is safe."""
    # No metrics: after a node dies, Ray's metrics export keeps the GCS and the head's
    # dashboard agent busy at a core each, which starves the (niced) ranks on this 2-core
    # machine: steps 20 times slower, long enough to look hung.
    head = {"num_cpus": head_cpus, "include_dashboard": False, "_system_config": {"enable_metrics_collection": False}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = [add_node(cluster, cpus) for cpus in node_cpus]
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
