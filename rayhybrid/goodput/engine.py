"""The discrete-event simulation of one recovery strategy on one failure trace.

The run is in one phase at a time: training towards the next save, a blocking save, recovering
(detection, then the strategy's restart, heal or resize), waiting for a node, or stopped. The
next event is the earliest of the phase's end, the trace's next failure and the run's end.
Every failure that reaches the run goes through rayhybrid's own `FailurePolicy.decide`
(restart or give up); the elastic strategies ask rayhybrid's `ScalingPolicy` which replicas to
go on with after a loss (`on_loss`) and which to grow to at a save (`on_checkpoint`); peer
healing asks its `HealPolicy` whether the failed shard still has a live copy (`choose`).

Time is accounted to kept work or to one cause of loss, so that kept + lost = the wall time.
While an elastic run is shrunk to a fraction f of its replicas, f of each second goes to its
phase and 1 - f to waiting for nodes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from rayhybrid.config.goodput import CostsConfig, Strategy
from rayhybrid.driver.policies import Failure, FailurePolicy, HealPolicy, ScalingPolicy
from rayhybrid.goodput.failures import Category, Trace

CAUSES = ("detection", "restart", "redone_work", "checkpoint", "waiting_for_nodes", "stopped")
RUN, SAVE, RECOVER, WAIT, STOPPED = range(5)
INF = math.inf


@dataclass(frozen=True)
class Job:
    """What every strategy shares: the layout, the failures, the costs and the policies."""

    dp: int
    nodes_per_replica: int
    categories: list[Category]
    costs: CostsConfig
    spare_nodes: int
    repair_s: float
    seconds: float
    failure_policy: FailurePolicy
    min_dp: int
    heal_policy: HealPolicy = field(default_factory=HealPolicy)


@dataclass
class Outcome:
    """One strategy on one trace: kept work and lost time in seconds of the whole job."""

    name: str
    interval_s: float
    wall_s: float
    kept_s: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    failures: int = 0
    restarts: int = 0
    heals: int = 0
    fallbacks: int = 0
    shrinks: int = 0
    grows: int = 0
    min_dp: int = 0
    stopped: str = ""

    @property
    def effective_time(self) -> float:
        return self.kept_s / self.wall_s


def cause(index: int) -> str:
    """A name of its own for the trace's failure `index`, in letters (the policy masks digits):
    drawn failures are independent, so none is another one repeating."""
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("a") + rest) + letters
    return f"cause {letters}"


def shard_heals(
    policy: HealPolicy, replicas: Sequence[int], lost: set[int], peers_survive: bool, step: int = 1, saved: int = 0
) -> bool:
    """Whether rayhybrid's heal policy heals the failed shard, whose copies are one per replica in
    `replicas` at `step` (the checkpoint's at `saved`): those of the `lost` replicas are gone, and
    every copy when the failure leaves no peer with the state (`Category.peers_survive`)."""
    copies = [None if not peers_survive or r in lost else step for r in replicas]
    return policy.choose({"failed shard": copies}, saved) is not None


class Simulation:
    """One strategy's run over the trace; `run()` returns its `Outcome`."""

    def __init__(self, strategy: Strategy, job: Job, interval_s: float) -> None:
        self.s, self.job, self.tau, self.c = strategy, job, interval_s, job.costs
        self.scaling = ScalingPolicy(list(range(job.min_dp, job.dp + 1)), job.min_dp, elastic=strategy.elastic)
        self.active = self.scaling.on_start(list(range(job.dp))) if strategy.elastic else list(range(job.dp))
        self.active_set, self.f = set(self.active), len(self.active) / job.dp
        self.out = Outcome(strategy.name, interval_s, job.seconds, min_dp=len(self.active))
        self.t = self.pos = self.saved = 0.0
        self.phase, self.save_left, self.detect_left, self.restart_left = RUN, 0.0, 0.0, 0.0
        self.free, self.need, self.pending = (job.spare_nodes if strategy.spares else 0), 0, (0.0, 0.0)
        self.repairs: deque[float] = deque()
        self.earlier: dict[int, list[Failure]] = {}
        self.healing: set[int] = set()  # replicas whose state a heal under way is sending
        if not self.active:
            self.stop("fewer than elastic.min_dp replicas to start on")

    def run(self, trace: Trace) -> Outcome:
        times, kinds, nodes, end = trace.times, trace.kinds, trace.nodes, self.job.seconds
        i, n = 0, len(times)
        while self.t < end and self.phase != STOPPED:
            next_failure = times[i] if i < n else INF
            done = self.phase_end()
            t = min(next_failure, done, end)
            self.advance(t)
            if t >= end:
                break
            if next_failure <= done:
                self.on_failure(kinds[i], nodes[i], i)
                i += 1
            else:
                self.finish_phase()
        self.advance(end)
        self.out.kept_s = self.pos
        return self.out

    def phase_end(self) -> float:
        if self.phase == RUN:
            return self.t + (self.saved + self.tau - self.pos) / self.f
        if self.phase == SAVE:
            return self.t + self.save_left
        if self.phase == RECOVER:
            return self.t + self.detect_left + self.restart_left
        if self.phase == WAIT:
            return self.repairs[0] if self.repairs else INF
        return INF

    def advance(self, t: float) -> None:
        """Account the time from self.t to t to the current phase."""
        dt, lost, self.t = t - self.t, self.out.lost, t
        if dt <= 0:
            return
        if self.phase in (WAIT, STOPPED):
            lost["waiting_for_nodes" if self.phase == WAIT else "stopped"] += dt
            return
        if self.f < 1.0:
            lost["waiting_for_nodes"] += dt * (1.0 - self.f)
        if self.phase == RUN:
            self.pos += dt * self.f
        elif self.phase == SAVE:
            lost["checkpoint"] += dt * self.f
            self.save_left -= dt
        else:
            detect = min(dt, self.detect_left)
            self.detect_left -= detect
            self.restart_left -= dt - detect
            lost["detection"] += detect * self.f
            lost["restart"] += (dt - detect) * self.f

    def finish_phase(self) -> None:
        if self.phase == RUN:
            self.pos, self.phase, self.save_left = self.saved + self.tau, SAVE, self.c.save_s
        elif self.phase == SAVE:
            self.saved, self.phase = self.pos, RUN
            if self.s.elastic:
                self.maybe_grow()
        elif self.phase == RECOVER:
            self.healing = set()
            self.phase = SAVE if self.pos >= self.saved + self.tau else RUN  # a heal mid-save
            self.save_left = self.c.save_s
        elif self.phase == WAIT:
            self.take_nodes()

    def on_failure(self, kind: int, node: int, index: int) -> None:
        cat = self.job.categories[kind]
        if node >= 0 and node // self.job.nodes_per_replica not in self.active_set:
            return  # a node the run does not use (an elastic run's idle replica)
        self.out.failures += 1
        failure = Failure(int(self.pos // self.c.step_s) + 1, f"{cat.name} ({cause(index)})", external=cat.external)
        earlier = self.earlier.setdefault(failure.step, [])
        decision = self.job.failure_policy.decide(failure, earlier, self.out.restarts)
        earlier.append(failure)
        if not decision.restart:
            self.stop(decision.reason)
            return
        self.out.restarts += 1
        heal = self.s.heal and self.heals(cat, node)
        keep = max(self.saved, self.pos // self.c.step_s * self.c.step_s) if heal else self.saved
        self.out.heals += heal
        self.out.fallbacks += self.s.heal and not heal
        self.out.lost["redone_work"] += self.pos - keep
        self.pos = keep
        detect = self.c.hang_detect_s if cat.hang else self.c.detect_s
        cost = self.c.heal_s if heal else getattr(self.c, self.s.fallback_cost)
        if node < 0:  # nothing to replace: recover at once, or once the awaited nodes are back
            if self.phase == WAIT:
                self.wait(detect, cost)
            else:
                self.recover(detect, cost)
            return
        self.repairs.append(self.t + self.job.repair_s)
        if self.s.elastic:
            self.lose_node(node // self.job.nodes_per_replica)
            if self.phase != STOPPED:
                self.recover(detect, cost)
            return
        self.need += 1
        self.wait(detect, cost)

    def heals(self, cat: Category, node: int) -> bool:
        """rayhybrid's heal policy on the failed shard's copies (`shard_heals`), one per replica in
        use: the failed replica's is lost, and so is that of a replica a heal under way had not
        reached yet."""
        replica = node // self.job.nodes_per_replica if node >= 0 else self.active[0]
        lost = {replica} | (self.healing if self.phase in (RECOVER, WAIT) else set())
        step, saved = int(self.pos // self.c.step_s), int(self.saved // self.c.step_s)
        if not shard_heals(self.job.heal_policy, self.active, lost, cat.peers_survive, step, saved):
            return False
        self.healing = lost
        return True

    def collect(self) -> None:
        """Repaired nodes go back to the pool."""
        while self.repairs and self.repairs[0] <= self.t:
            self.repairs.popleft()
            self.free += 1

    def wait(self, detect: float, cost: float) -> None:
        """Recover once the nodes the run waits for are there."""
        self.phase, self.pending = WAIT, (detect, cost)
        self.take_nodes()

    def take_nodes(self) -> None:
        self.collect()
        taken = min(self.free, self.need)
        self.free, self.need = self.free - taken, self.need - taken
        if self.need == 0:
            self.recover(*self.pending)

    def recover(self, detect: float, cost: float) -> None:
        self.phase, self.detect_left, self.restart_left = RECOVER, detect, cost

    def lose_node(self, replica: int) -> None:
        """An elastic run replaces a failed node from the pool, else shrinks without its replica."""
        self.collect()
        if self.free > 0:
            self.free -= 1
            return
        keep = self.scaling.on_loss(self.active, {replica})
        if not keep:
            self.stop(f"replica {replica} lost and fewer than elastic.min_dp={self.job.min_dp} replicas left")
            return
        dropped = len(self.active) - len(keep)
        self.free += dropped * self.job.nodes_per_replica - 1  # the dropped replicas' healthy nodes
        self.set_active(keep)
        self.out.shrinks += 1

    def maybe_grow(self) -> None:
        """At a save: grow to the replicas the free nodes make up, if the policy says so."""
        self.collect()
        whole = self.free // self.job.nodes_per_replica
        if whole == 0 or len(self.active) == self.job.dp:
            return
        idle = [r for r in range(self.job.dp) if r not in self.active_set][:whole]
        grown = self.scaling.on_checkpoint(self.active, [*self.active, *idle])
        if grown is None:
            return
        self.free -= (len(grown) - len(self.active)) * self.job.nodes_per_replica
        self.set_active(grown)
        self.out.grows += 1
        self.recover(0.0, self.c.restart_s)  # the larger group restores the checkpoint just written

    def set_active(self, replicas: list[int]) -> None:
        self.active, self.active_set, self.f = list(replicas), set(replicas), len(replicas) / self.job.dp
        self.out.min_dp = min(self.out.min_dp, len(replicas))

    def stop(self, reason: str) -> None:
        self.out.lost["redone_work"] += self.pos - self.saved
        self.pos, self.phase, self.out.stopped = self.saved, STOPPED, reason
