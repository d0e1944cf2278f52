"""The brief check of the nodes a run starts using after its start (cluster.check=brief): a node
an elastic run grows onto, a replica's new node after a node loss, an evacuation's target. Each
node once per run, before any rank of the run trains there: the same per-node facts as the
start's check (no store: the storage check covers it; no bandwidth), each problem a warning, a
`check` event with `"joined": true`.

    joins = JoinCheck(cfg, shape, runlog.event, startup_check(cfg, shape, runlog.event))
    bad = joins.refused(group.nodes_of(slots))    # node ids the run must keep off (drained)

A node whose torch or rayhybrid differs from the driver's does not stop the run, as it does at
the start: Ray is asked to drain it (it places nothing new there, as for a preemption notice),
and the launcher moves the replicas placed there elsewhere (rayhybrid/driver/launcher.py).
"""

from __future__ import annotations

import logging

import ray

from rayhybrid.check.run import Checked, brief_check
from rayhybrid.cluster.placement import ReplicaShape
from rayhybrid.cluster.spot_watch import drain_node
from rayhybrid.config.schema import Config

log = logging.getLogger("rayhybrid")

DRAIN_MESSAGE = "rayhybrid cluster check: torch or rayhybrid differs from the driver's"


class JoinCheck:
    """The nodes checked so far (`seen`) and those failed for good (`bad`), for one run."""

    def __init__(self, cfg: Config, shape: ReplicaShape, record, started: Checked | None) -> None:
        self.cfg, self.shape, self.record = cfg, shape, record
        self.seen: set[str] | None = {n.id for n in started.nodes} if started is not None else None
        """None: the start's check did not run (off, or it failed): the first nodes go unchecked, as the start's did."""
        self.bad: set[str] = set()

    def refused(self, nodes) -> frozenset[str]:
        """Of `nodes` (ids: those the run is about to train on), the ones its ranks must keep
        off: checked now (those not checked before) or earlier, with a fatal problem."""
        nodes = set(nodes)
        if self.seen is None:
            self.seen = nodes
        new = nodes - self.seen
        if new:
            self.seen |= new
            self.bad |= self._check(frozenset(new))
        return frozenset(nodes & self.bad)

    def _check(self, nodes: frozenset[str]) -> set[str]:
        """`brief_check` of `nodes` (none with cluster.check=off; a check that cannot run warns
        once and lets them in); the nodes with a fatal problem, drained."""
        checked = brief_check(self.cfg, self.shape, self.record, only=nodes)
        if checked is None:
            return set()
        names = {n.name: n.id for n in checked.nodes}
        fatal = {names[p.node] for p in checked.problems if p.fatal and p.node in names}
        for node in sorted(fatal):
            log.warning("cluster check: keeping the run's ranks off node %s (draining it)", node[:8])
            keep_off(node)
        return fatal


def keep_off(node: str) -> bool:
    """Ask Ray to drain `node`, so it places nothing new there; never the driver's own node (Ray
    shuts a drained node down once idle). Whether Ray accepted."""
    if node == ray.get_runtime_context().get_node_id():
        log.warning("cluster check: node %s is the driver's own node, which is not drained", node[:8])
        return False
    return drain_node(node, DRAIN_MESSAGE)
