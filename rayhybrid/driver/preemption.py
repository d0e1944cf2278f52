"""Preemption notices: nodes of the run that Ray is draining (a spot node's notice, an
autoscaler scaling in, a straggler's node with `fault.straggler=evacuate`), polled at most once
every `DRAIN_POLL_S`, and moving the replicas off them once the step the run is at is
checkpointed (the controller saves it first).

The drain watch also attaches the run's straggler watch (rayhybrid/driver/stragglers.py) to the
run log, unless `fault.straggler=off`: with `evacuate` it asks Ray to drain a straggler's node,
which this watch then sees as any drained node."""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time

from rayhybrid.cluster.group import not_placed_again
from rayhybrid.cluster.placement import draining_nodes
from rayhybrid.cluster.spot import detect_cloud
from rayhybrid.cluster.spot_watch import drain_straggler_node, start_watchers
from rayhybrid.driver.records import Interruption
from rayhybrid.driver.state import Failed, Resizing, RunState
from rayhybrid.driver.stragglers import StragglerWatch
from rayhybrid.errors import RunFailed

log = logging.getLogger("rayhybrid")

DRAIN_POLL_S = 1.0


class DrainWatch:
    def __init__(self, cfg, scaling, ledger, poll_s: float = DRAIN_POLL_S) -> None:
        self.cfg, self.scaling, self.ledger = cfg, scaling, ledger
        self.poll_s = poll_s
        self.next_poll = 0.0  # the rate limit's own memory, not the run's state
        # cluster.spot_notices: a watcher per node of the run, when this node sees a cloud
        # (probed in the background: a run without one never waits for the probe).
        self.cloud = _in_background(detect_cloud) if cfg.cluster.spot_notices else None
        self.watched: dict[str, object] = {}  # node id -> its watcher actor
        self.stragglers = StragglerWatch(cfg.fault, ledger.log, drain=drain_straggler_node)
        if cfg.fault.straggler != "off":
            ledger.log.attach(self.stragglers)

    def notice(self, group, evacuated: frozenset[str]) -> dict[str, float]:
        """Nodes of the replicas `group` trains on being drained and not moved off yet: node id
        -> seconds left to the deadline (inf: none given). {} between polls."""
        now = time.monotonic()
        if now < self.next_poll:
            return {}
        self.next_poll = now + self.poll_s
        nodes = None  # the run's nodes, asked of Ray only when needed, at most once a poll
        if self.cloud is not None and self.cloud.done() and self.cloud.result():
            nodes = group.nodes_of(list(group.slots))
            new = [n for n in nodes if n not in self.watched]
            if new:  # nodes the run uses now that no watcher has seen yet
                self.watched.update(start_watchers(new, self.cfg.cluster.spot_poll_s))
                log.info("watching %d more node(s) for %s spot notices", len(new), self.cloud.result())
        draining = draining_nodes()
        if not draining:
            return {}
        ours = set(nodes if nodes is not None else group.nodes_of(list(group.slots))) - evacuated
        return {n: (d / 1000 - time.time() if d else math.inf) for n, d in draining.items() if n in ours}

    @staticmethod
    def draining() -> set[str]:
        """Every node Ray is draining now."""
        return set(draining_nodes())

    def announce(self, notice: dict[str, float], step: int) -> None:
        node, left = min(notice.items(), key=lambda kv: kv[1])
        log.warning(
            "node %s is being drained (%s; %s): checkpointing step %d and moving off it",
            node[:8],
            self.stragglers.drained.get(node, "preemption"),
            f"{left:.0f}s to its deadline" if math.isfinite(left) else "no deadline",
            step,
        )

    def evacuate(self, run: RunState, group, notice: dict[str, float], since: float) -> Resizing | Failed:
        """The step the run is at is checkpointed: move the replicas off the draining nodes
        before their deadline (elastic: go on with the others; fixed: wait for room elsewhere,
        up to cluster.placement_timeout_s). No step is trained twice. If the node goes first,
        the next step fails and recovery takes over."""
        node, left = min(notice.items(), key=lambda kv: kv[1])
        run, saved = run.but(evacuated=run.evacuated | set(notice)), run.committed or 0
        self.ledger.log.event(
            {"event": "preemption", "node": node, "deadline_s": round(left, 3) if math.isfinite(left) else None}
            | {"reason": "straggler" if node in self.stragglers.drained else "preemption"}
            | {"saved_step": saved, "lost_steps": run.step - saved}
        )
        bad = slots_on(group, group.slots, notice)
        group.replace(bad)
        slots = self.scaling.on_loss(list(group.slots), set(bad)) if self.scaling.elastic else []
        mark = time.perf_counter()
        if not slots:  # a fixed-size run, or too few replicas left: wait for room elsewhere
            wait_s = self.cfg.cluster.placement_timeout_s
            lost = group.wait_placed(bad, wait_s)
            if lost:
                why = why_not_placed(self.scaling, group.dp, lost, wait_s)
                return Failed(run, RunFailed(f"{why}; {self.ledger.last_good()}"))
            slots = list(group.slots)
        why = f"a straggler's ({self.stragglers.drained[node]})" if node in self.stragglers.drained else "preempted"
        place_s, cause = time.perf_counter() - mark, f"node {node[:8]} {why}"
        intr = Interruption("preempt", cause, run.step, group.dp, save_s=mark - since, since=since, place_s=place_s)
        return Resizing(run, tuple(slots), intr)


def _in_background(fn) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spot-probe")
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def slots_on(group, slots, nodes) -> list[int]:
    """The replica slots among `slots` with a worker on one of `nodes`."""
    return [slot for slot in slots if set(group.nodes_of([slot])) & set(nodes)]


def why_not_placed(scaling, dp: int, lost: set[int], wait_s: float) -> str:
    """Why the run cannot go on after `lost` replica slots were not placed again."""
    if not scaling.elastic:
        return not_placed_again(len(lost), wait_s)
    return (
        f"{dp - len(lost)} replica(s) left after losing {len(lost)}, below elastic.min_dp={scaling.min_dp}; "
        "add nodes or lower elastic.min_dp"
    )
