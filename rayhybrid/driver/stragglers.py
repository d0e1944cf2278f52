"""Stragglers: a rank whose own compute is slower than its peers' step after step (a throttled
GPU, a noisy neighbour, a bad host), named with its node, and with `fault.straggler=evacuate`
moved off.

    policy = StragglerPolicy(placement, slowdown=1.2, steps=5)   # pure: no Ray, no files
    for named in policy.observe(step, record["compute_s_by_rank"]):
        ...                                                       # one `Named` per node

The rule: a rank's peers are the other ranks of its pipeline stage (same pp coordinate: every
data-parallel replica's and tensor-parallel rank's share of that stage, the same work). A step
counts against a rank when its compute seconds (`compute_s_by_rank`, waits on collectives,
p2p, data and the host excluded) are at least `slowdown` times the median of its peers'. After
`steps` such steps in a row the rank is straggling; its node is named once for the episode,
with every rank of that node straggling then (a node's tensor-parallel group slowed together
is one node, one name). The episode ends after `steps` steps in a row below the rule (a rank
that dips below for one step only starts its count again; it is not named again). A stage of
one rank (dp 1 and tp 1) has no peers: nothing is detected, said once.

`StragglerWatch` is the run's reporter of it (rayhybrid/driver/reporting.py): the warning
line, the `straggler` event in metrics.jsonl (the trackers get it with every event),
summary.json's `stragglers`; with `evacuate` it asks Ray to drain the node (as a spot notice
does, rayhybrid/cluster/spot_watch.py), and the run's drain watch (driver/preemption.py)
checkpoints the step and moves off it.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from rayhybrid.driver.reporting import Reporter

log = logging.getLogger("rayhybrid")

MIN_PEER_COMPUTE_S = 1e-3
PEER_COMPUTE_SHARE = 0.01
"""A stage whose peers' median compute is below max(MIN_PEER_COMPUTE_S, PEER_COMPUTE_SHARE x
the step's time) counts neither way at that step (the ratio to ~0 means nothing)."""


@dataclass(frozen=True)
class Named:
    """A node named as a straggler at `step`: the slowest of its straggling ranks (`rank` and
    its coordinates), all of them (`ranks`), and how much slower than its peers' median that
    rank was (the median of its ratios over the `steps` steps)."""

    step: int
    node: str
    ip: str
    rank: int
    coords: tuple[int, int, int]
    ranks: tuple[int, ...]
    slowdown: float
    steps: int


@dataclass
class _Count:
    slow: int = 0
    calm: int = 0
    ratios: list[float] = field(default_factory=list)
    straggling: bool = False


class StragglerPolicy:
    """The rule over one placement (rank -> dp, pp, tp, node_id, ip, as `WorkerGroup.placement`
    gives it). `observe` takes each step's per-rank compute seconds and returns the nodes named
    at that step."""

    def __init__(self, placement: list[dict], slowdown: float, steps: int) -> None:
        self.slowdown, self.steps = slowdown, steps
        self.where = {p["rank"]: p for p in placement}
        stages: dict[int, list[int]] = {}
        for p in placement:
            stages.setdefault(p["pp"], []).append(p["rank"])
        self.peers = {r: [q for q in stages[p["pp"]] if q != r] for r, p in self.where.items()}
        self.counts = {r: _Count() for r in self.where}
        self.named: set[str] = set()  # nodes named in their current episode

    @property
    def has_peers(self) -> bool:
        return any(self.peers.values())

    def observe(self, step: int, compute_s: list[float | None] | None, step_time_s: float = 0.0) -> list[Named]:
        """One step's compute seconds, in rank order (None, or a shorter list: not measured,
        the step counts neither way). A rank whose peers' median compute is below the floor,
        max(1 ms, 1% of the record's `step_time_s`), counts neither way at that step: against
        peers computing ~nothing any rank's ratio is huge and says nothing."""
        if not compute_s or len(compute_s) != len(self.where) or any(c is None for c in compute_s):
            return []
        floor = max(MIN_PEER_COMPUTE_S, PEER_COMPUTE_SHARE * (step_time_s or 0.0))
        for rank, count in self.counts.items():
            peers = [compute_s[q] for q in self.peers[rank]]
            if peers and statistics.median(peers) < floor:
                continue
            ratio = compute_s[rank] / statistics.median(peers) if peers else 0.0
            if ratio >= self.slowdown:
                count.slow, count.calm = count.slow + 1, 0
                count.ratios = [*count.ratios[-(self.steps - 1) :], ratio] if self.steps > 1 else [ratio]
                count.straggling = count.straggling or count.slow >= self.steps
            else:
                count.slow, count.calm = 0, count.calm + 1
                if not count.straggling or count.calm >= self.steps:
                    count.straggling, count.ratios = False, []
        return self._name(step)

    def _name(self, step: int) -> list[Named]:
        by_node: dict[str, list[int]] = {}
        for rank, count in self.counts.items():
            if count.straggling:
                by_node.setdefault(self.where[rank]["node_id"], []).append(rank)
        self.named &= set(by_node)  # a node none of whose ranks straggles any more: its episode ended
        out = []
        for node, ranks in by_node.items():
            if node in self.named:
                continue
            self.named.add(node)
            worst = max(ranks, key=lambda r: statistics.median(self.counts[r].ratios))
            p = self.where[worst]
            slowdown = round(statistics.median(self.counts[worst].ratios), 3)
            out.append(
                Named(step, node, p["ip"], worst, (p["dp"], p["pp"], p["tp"]), tuple(ranks), slowdown, self.steps)
            )
        return out


class StragglerWatch(Reporter):
    """fault.straggler (warn or evacuate) as the run's reporter: a policy per placement (a new
    one whenever the workers (re)start), fed every step's `compute_s_by_rank`."""

    def __init__(self, fault, runlog, drain=None) -> None:
        self.action, self.slowdown, self.steps = fault.straggler, fault.straggler_slowdown, fault.straggler_steps
        self.runlog = runlog
        self.drain = drain
        """node id, message -> whether Ray drains it (evacuate); tests pass their own."""
        self.policy: StragglerPolicy | None = None
        self.named: list[dict] = []
        self.said_no_peers = False
        self.drained: dict[str, str] = {}
        """Nodes this watch asked Ray to drain -> why (the drain watch's cause for the move)."""

    def after_workers_start(self, placement: list[dict], description: dict) -> None:
        self.policy = StragglerPolicy(placement, self.slowdown, self.steps)
        if not self.policy.has_peers and not self.said_no_peers:
            self.said_no_peers = True
            log.info(
                "fault.straggler: no stragglers can be named: every pipeline stage has one rank (dp 1, tp 1), "
                "so no rank has peers doing the same work"
            )

    def after_step(self, record) -> None:
        if self.policy is None:
            return
        for named in self.policy.observe(
            record["step"], record.get("compute_s_by_rank"), record.get("step_time_s") or 0.0
        ):
            self.name(named)

    def name(self, n: Named) -> None:
        """The warning line and the event; with evacuate, Ray asked first to drain the node (the
        event's action says "warn" where it refused, or for the driver's own node)."""
        dp, pp, tp = n.coords
        action = "evacuate" if self.action == "evacuate" and self._drain(n) else "warn"
        others = [r for r in n.ranks if r != n.rank]
        log.warning(
            "straggler: rank %d (dp %d, pp %d, tp %d)%s on node %s (%s) computes %.2fx its peers' median "
            "for %d steps in a row at step %d; %s",
            *(n.rank, dp, pp, tp, f" (and rank(s) {', '.join(map(str, others))})" if others else ""),
            *(n.node[:8], n.ip, n.slowdown, n.steps, n.step),
            "moving off it" if action == "evacuate" else "set fault.straggler=evacuate to move off it",
        )
        record = {"event": "straggler", "step": n.step, "rank": n.rank, "dp": dp, "pp": pp, "tp": tp}
        record |= {"ranks": list(n.ranks), "node": n.node, "ip": n.ip, "slowdown": n.slowdown, "steps": n.steps}
        record["action"] = action
        self.named.append({k: v for k, v in record.items() if k != "event"})
        self.runlog.event(record)

    def _drain(self, n: Named) -> bool:
        """Ask Ray to drain the straggler's node (once): whether it is being drained."""
        if n.node in self.drained:
            return True
        why = f"straggler: rank {n.rank} computes {n.slowdown:.2f}x its peers' median"
        if self.drain is None or not self.drain(n.node, f"rayhybrid {why} (fault.straggler=evacuate)"):
            return False
        self.drained[n.node] = why
        return True

    def before_close(self, summary: dict, history: list) -> None:
        summary["stragglers"] = self.named
