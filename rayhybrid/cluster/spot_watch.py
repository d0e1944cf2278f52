"""Cloud spot notices into Ray's drain: one `SpotWatcher` (rayhybrid/cluster/spot.py) per node of
the run, each in a small Ray actor pinned to its node, which on the cloud's notice asks Ray to
drain its own node with the notice's deadline and the reason preemption. From there the run's
drain watch (rayhybrid/driver/preemption.py) checkpoints the step it is at and moves off the
node, as for any drain.

Why an actor per node, started by the run: the notice is only readable on the node itself (the
metadata server is link-local), the actor needs no setup in the cluster's YAML, it goes with the
run, and nodes an autoscaler adds later get theirs when the run first uses them. The driver
starts them only when its own node sees a metadata server, so a run without a cloud costs one
failed probe and no process.

    watchers = start_watchers(node_ids, interval_s=5.0)   # node id -> actor, not waited for
"""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.cluster.spot import Notice, SpotWatcher

log = logging.getLogger("rayhybrid")


def preemption_reason() -> int:
    """Ray's drain reason for a preemption: its own enum's member (Ray's autoscaler protobuf,
    `DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION`), never a copied number."""
    from ray.core.generated.autoscaler_pb2 import DrainNodeReason

    return DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION


class NodeSpotWatch:
    """The watcher of one node. `start()` says which cloud it found; with none, the actor ends."""

    def __init__(self, gcs_address: str, node_id: str, interval_s: float) -> None:
        self.gcs_address, self.node_id = gcs_address, node_id
        self.watcher = SpotWatcher(self._drain, interval_s=interval_s)

    def start(self) -> str | None:
        if self.watcher.start():
            return self.watcher.cloud
        ray.actor.exit_actor()  # nothing to watch here: no process left behind
        return None

    def _drain(self, notice: Notice) -> None:
        message = f"{notice.cloud} spot notice: {notice.detail}"
        drain_node(self.node_id, message, int(notice.deadline_s * 1000), self.gcs_address)


def drain_node(node_id: str, message: str, deadline_ms: int = 0, gcs_address: str | None = None) -> bool:
    """Ask Ray to drain `node_id` (hex) as for a preemption: Ray places nothing new there, and
    the run's drain watch moves off it. `deadline_ms`: when the node goes (ms since the epoch;
    0: no deadline). Whether Ray accepted; a refusal is logged."""
    from ray._raylet import GcsClient

    address = gcs_address or ray.get_runtime_context().gcs_address
    accepted, why = GcsClient(address=address).drain_node(node_id, preemption_reason(), message, deadline_ms)
    if not accepted:
        log.warning("node %s: Ray refused to drain it (%s): %s", node_id[:8], message, why)
    return accepted


def start_watchers(nodes, interval_s: float = 5.0) -> dict[str, object]:
    """Start a watcher on each of `nodes` (node ids), without waiting: node id -> its actor
    (keep the handles: an actor goes when its last handle does). One that finds no cloud ends
    on its own."""
    actor_cls = ray.remote(num_cpus=0, max_restarts=0)(NodeSpotWatch)
    gcs = ray.get_runtime_context().gcs_address
    watchers = {}
    for node in nodes:
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        watchers[node] = actor_cls.options(scheduling_strategy=strategy).remote(gcs, node, interval_s)
        watchers[node].start.remote()
    return watchers


def drain_straggler_node(node_id: str, message: str) -> bool:
    """`drain_node` for a straggler's node (fault.straggler=evacuate), never the driver's own:
    Ray shuts a drained node down once nothing runs on it, and the driver runs there (on a
    single-node run, the only node). Whether Ray accepted."""
    if node_id == ray.get_runtime_context().get_node_id():
        log.warning(
            "fault.straggler=evacuate: node %s is the driver's own node, which is not drained (Ray would shut it "
            "down once idle); the run stays on it",
            node_id[:8],
        )
        return False
    return drain_node(node_id, message)
