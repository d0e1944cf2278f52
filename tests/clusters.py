"""Multi-node tests on one machine: a `ray.cluster_utils.Cluster` of several raylets.

    with local_cluster(head_cpus=0, node_cpus=[2, 2, 2]) as (cluster, nodes):
        ...   # ray is initialised against it; nodes can be removed and added

No dashboard anywhere: its agent takes a whole core of this 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

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


@contextlib.contextmanager
def ray_start_head(args: list[str], env: dict, log_dir: Path, ports: list[int]):
    """`ray start --head --block ARGS` in a process group of its own, until every port in
    `ports` accepts connections; stopped by that group afterwards (never `ray stop`, which
    would kill every Ray on the machine)."""
    temp = Path("/tmp") / f"rh-{uuid.uuid4().hex[:8]}"  # short: Ray's socket paths have a length limit
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--temp-dir={temp}", *args]
    log_path = log_dir / f"head-{ports[0]}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                for port in ports:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the head did not start"
            time.sleep(0.5)
        yield
    finally:
        # `ray start --block` outlives a SIGTERM by 15 s or more (measured: the whole 15 s wait
        # every time), while its raylet and GCS, in the same group, go at once; the group's
        # SIGKILL after a short grace ends what is left the same way, 12 s sooner per head.
        for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 15)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        log.close()
