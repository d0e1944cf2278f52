"""The driver's rules, as pure functions of what happened: they return decisions and act on
nothing, so each rule is unit-tested in milliseconds without Ray (tests/test_policy.py).

    failures = FailurePolicy(max_restarts=3)
    decision = failures.decide(failure, earlier_failures, restarts_so_far)   # restart or give up

    scaling = ScalingPolicy(usable=[1, 2, 3], min_dp=1, elastic=True)
    slots = scaling.on_start(placed=[0, 1])               # the replica slots to start on
    slots = scaling.on_loss(active=[0, 1, 2], lost={1})    # [0, 2]: shrink to what is left
    slots = scaling.on_checkpoint(active=[0, 2], placed=[0, 1, 2])   # [0, 2, 1]: grow
    hsdp = ScalingPolicy(usable=[2, 4], min_dp=2, group=2)   # topology.dp_shard=2
    slots = hsdp.on_loss(active=[0, 1, 2, 3], lost={1})      # [2, 3]: the whole group

    healing = HealPolicy(enabled=True)
    plan = healing.choose({(0, 0): [7, None], (0, 1): [7, 7]}, checkpoint_step=5)
    # HealPlan(step=7, sources={(0, 0): {1: 0}}): replica 1 of shard (0, 0) from replica 0
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from rayhybrid.config.validate import usable_dps


@dataclass(frozen=True)
class Failure:
    """A failed call of the worker group, as the driver saw it."""

    step: int
    """The step being trained when it failed (the one after the last completed step)."""
    message: str
    """The first failing rank's one-line error, e.g. "rank 2: RuntimeError: ..."."""
    external: bool = False
    """Caused from outside the training code: a node was lost, or `fault.inject` fired. Such a
    failure is never the same failure repeating, whatever its message."""

    @property
    def signature(self) -> str:
        """The message with every number masked (ranks, ports, addresses, pointers and group
        names change between attempts of the same failure)."""
        return re.sub(r"0x[0-9a-fA-F]+|\d+", "#", self.message)

    def repeats(self, earlier: Failure) -> bool:
        """Whether this is `earlier` happening again: same step, same cause, both from inside."""
        return (
            not self.external
            and not earlier.external
            and self.step == earlier.step
            and self.signature == earlier.signature
        )


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str = ""
    """Why the run gives up (empty when it restarts)."""


@dataclass(frozen=True)
class FailurePolicy:
    """Restart after a failure unless restarts are used up (`fault.max_restarts`) or the
    failure repeats one seen before (same step, same cause), which a restart will not fix."""

    max_restarts: int

    def decide(self, failure: Failure, earlier: Sequence[Failure], restarts: int) -> Decision:
        if restarts >= self.max_restarts:
            return Decision(
                False,
                f"giving up after {restarts} restart(s) (fault.max_restarts={self.max_restarts}): {failure.message}",
            )
        if any(failure.repeats(e) for e in earlier):
            return Decision(False, f"step {failure.step} failed twice, the same way it will again: {failure.message}")
        return Decision(True)


@dataclass(frozen=True)
class ScalingPolicy:
    """Which replica slots (placement groups, one per data-parallel replica) to train on.

    `usable`: the dp values that split the global batch into whole micro-batches, ascending. A
    fixed-size run has one (topology.dp) and never shrinks; an elastic one uses the largest
    usable dp it can place, never below `min_dp`, and grows only at a checkpoint boundary."""

    usable: Sequence[int]
    min_dp: int
    elastic: bool = True
    group: int = 1
    """HSDP's shard group (`topology.dp_shard=N`): dp moves by whole groups of N consecutive
    slots (`usable` holds multiples of N only), and a shrink keeps the groups that lost no
    replica first, so their ranks keep the shards they hold (and can heal the others)."""

    @classmethod
    def of(cls, cfg) -> ScalingPolicy:
        """The policy a config asks for: its topology.dp alone, or elastic.* over the dp values
        that split the global batch."""
        group = cfg.topology.dp_multiple
        if not cfg.elastic.enabled:
            return cls([cfg.topology.dp], cfg.topology.dp, elastic=False, group=group)
        usable = usable_dps(cfg)  # whole shard groups only
        return cls(usable, min(d for d in usable if d >= cfg.elastic.min_dp), elastic=True, group=group)

    @property
    def slots(self) -> int:
        """Replica slots to reserve: one per replica of the largest usable dp."""
        return max(self.usable)

    def fit(self, replicas: int) -> int:
        """The largest usable dp with at most `replicas` replicas (0 if none)."""
        return max((dp for dp in self.usable if dp <= replicas), default=0)

    def on_start(self, placed: Sequence[int]) -> list[int]:
        """The slots to start on, given the placed ones (in slot order); empty when fewer than
        `min_dp` are placed."""
        use = list(placed)[: self.fit(len(placed))]
        return use if len(use) >= self.min_dp else []

    def on_loss(self, active: Sequence[int], lost: set[int] | frozenset[int]) -> list[int]:
        """After a failure in which the slots `lost` could not be placed again: the slots to go
        on with (the survivors, in their order, cut to a usable dp), or empty when the run cannot
        go on (a fixed-size run lost a replica, or fewer than `min_dp` are left)."""
        keep = [slot for slot in active if slot not in lost]
        if len(keep) < len(active) and not self.elastic:
            return []
        keep = self._whole_groups_first(active, lost)
        keep = keep[: self.fit(len(keep))]
        return keep if len(keep) >= self.min_dp else []

    def _whole_groups_first(self, active: Sequence[int], lost: set[int] | frozenset[int]) -> list[int]:
        """The survivors of `active`: those of the shard groups (`group` consecutive slots)
        that lost none first, then those of the others; each part in its order."""
        groups = [list(active[i : i + self.group]) for i in range(0, len(active), self.group)]
        whole = [slot for g in groups if not lost & set(g) for slot in g]
        return whole + [slot for g in groups if lost & set(g) for slot in g if slot not in lost]

    def on_checkpoint(self, active: Sequence[int], placed: Sequence[int]) -> list[int] | None:
        """At a checkpoint boundary: the larger set of slots to grow to, when more replicas are
        placed than in use and a larger usable dp fits them; else None. New slots go last, so
        the replicas in use keep their ranks."""
        if not self.elastic:
            return None
        spare = [slot for slot in placed if slot not in active]
        grown = self.fit(len(active) + len(spare))
        if grown <= len(active):
            return None
        return [*active, *spare[: grown - len(active)]]


@dataclass(frozen=True)
class HealPlan:
    """How the run heals to `step`: every rank that holds that step keeps it; each receiver of
    `sources[shard]` gets it from the data-parallel replica named there."""

    step: int
    sources: Mapping[Hashable, Mapping[int, int]]
    """shard -> {receiving replica: sending replica}; shards whose copies all hold `step` have none."""

    @property
    def transfers(self) -> int:
        return sum(len(s) for s in self.sources.values())


@dataclass(frozen=True)
class HealPolicy:
    """Peer healing or the checkpoint (`fault.heal`): heal when every shard of the model (a
    (pp, tp) coordinate, and with HSDP the shard coordinate in a dp shard group) still has a
    copy of the newest step any rank holds. The survivors of
    a failure may hold two steps (those that passed the last commit vote stepped, the others
    did not); healing goes forward to the newer, never back. A checkpoint newer than every copy,
    or a shard with no copy of that step, means the checkpoint (None)."""

    enabled: bool = True

    def choose(
        self, copies: Mapping[Hashable, Sequence[int | None]], checkpoint_step: int | None = None
    ) -> HealPlan | None:
        """`copies[shard][d]`: the step replica d's rank of that shard holds (None: nothing, a
        replacement). Receivers are spread over the replicas that hold the step."""
        if not self.enabled:
            return None
        held = [s for steps in copies.values() for s in steps if s is not None]
        if not held:
            return None
        step = max(held)
        if checkpoint_step is not None and checkpoint_step > step:
            return None
        sources = {}
        for shard, steps in copies.items():
            have = [d for d, s in enumerate(steps) if s == step]
            if not have:
                return None
            need = [d for d, s in enumerate(steps) if s != step]
            if need:
                sources[shard] = {d: have[i % len(have)] for i, d in enumerate(need)}
        return HealPlan(step, sources)
