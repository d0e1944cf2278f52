"""Putting a worker group to work, the driver's side: a new group for a start, placed and
started on the slots the scaling policy picks; the group in use rebuilt on other slots (a
resize, a recovery), after the broken replicas are placed again; and the run's state brought
into it, healed from the survivors' state or restored from the latest checkpoint.

    launcher = Launcher(cfg, scaling, ledger, drains, runlog, found)
    launcher.prepare()                                  # the cluster can ever hold the run
    start = launcher.start(run, pending)                # Start: run, group (or error), pending
    run, err = launcher.rebuild(run, group, slots)      # train on `slots`
    run, slots, why = launcher.replace(run, group, drained)   # after a failure's teardown
    run, intr = launcher.restore(run, group, intr, heal=True)

The controller holds the group a start returns and decides what to do with a failure; the
launcher never keeps a group. A start that fails stops what it built.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from rayhybrid.check.join import JoinCheck
from rayhybrid.check.run import startup_check
from rayhybrid.cluster.connect import resolve_shape
from rayhybrid.cluster.drain import Drained
from rayhybrid.cluster.group import WorkerGroup
from rayhybrid.cluster.placement import ReplicaShape, check_capacity
from rayhybrid.config.schema import Config, with_dp
from rayhybrid.driver.healing import Healing
from rayhybrid.driver.ledger import CheckpointLedger
from rayhybrid.driver.policies import ScalingPolicy
from rayhybrid.driver.preemption import DrainWatch, slots_on, why_not_placed
from rayhybrid.driver.records import Interruption
from rayhybrid.driver.runlog import RunLog, announce
from rayhybrid.driver.state import RunState
from rayhybrid.errors import RunFailed, WorkerError
from rayhybrid.storage import checkpoints

log = logging.getLogger("rayhybrid")


@dataclass(frozen=True)
class Start:
    """What a start came to: the run state as far as it got, and the group started (its
    state restored) or the error that stopped it (nothing is left of that group)."""

    run: RunState
    group: WorkerGroup | None = None
    error: WorkerError | None = None
    pending: Interruption | None = None
    """The restart this start is part of (a start again after one failed), with its figures."""


class Launcher:
    """Builds, rebuilds and restores the worker group: the placement of its replicas and the
    state its workers start from."""

    def __init__(
        self,
        cfg: Config,
        scaling: ScalingPolicy,
        ledger: CheckpointLedger,
        drains: DrainWatch,
        runlog: RunLog,
        found: checkpoints.Checkpoint | None,
    ) -> None:
        self.cfg, self.scaling, self.ledger, self.drains, self.log = cfg, scaling, ledger, drains, runlog
        self.healing = Healing(cfg, runlog)
        self.found = found
        """The latest checkpoint when the run opened: what its first start restores."""
        self.shape: ReplicaShape | None = None
        """A replica's resources, once `prepare` has asked the cluster."""
        self.joins: JoinCheck | None = None
        """The check of the nodes the run starts using later (rayhybrid/check/join.py)."""

    def prepare(self) -> None:
        """Before the first start: the cluster can ever hold the run; the run's first lines; the
        check of the nodes it will use (cluster.check: warnings and a `check` event)."""
        self.shape = resolve_shape(self.cfg)
        check_capacity(self.shape, self.scaling.min_dp)
        announce(self.cfg, self.scaling, self.shape.use_gpu)
        self.joins = JoinCheck(
            self.cfg, self.shape, self.log.event, startup_check(self.cfg, self.shape, self.log.event)
        )

    def start(self, run: RunState, pending: Interruption | None) -> Start:
        """Place the replicas, start the workers on the slots the scaling policy picks and
        restore the latest checkpoint. A group whose workers could not join is stopped and
        its error returned; any other error stops it and is raised."""
        group = WorkerGroup(self.cfg, self.shape, self.scaling.slots)
        mark = time.perf_counter()
        slots = tuple(self.scaling.on_start(group.reserve(self.scaling.min_dp)))
        placed = time.perf_counter()
        self.log.phase("placement")
        try:
            run, err = self.rebuild(run, group, slots)
        except BaseException:
            group.shutdown(graceful=False)
            raise
        if err is not None:
            group.shutdown(graceful=False)
            return Start(run, error=err)
        self.log.joined([d.get("startup") for d in group.descriptions])
        if pending is not None:  # a start again, after the one before failed
            init_s = time.perf_counter() - placed
            dp_before = pending.dp_before or group.dp
            pending = pending.but(place_s=placed - mark, init_s=init_s, dp_before=dp_before, dp_after=group.dp)
        try:
            run, pending = self.restore(run, group, pending)
        except BaseException:  # the group is not returned: stop it here
            group.shutdown(graceful=False)
            raise
        self.log.phase("restore")
        return Start(run, group, pending=pending)

    def rebuild(self, run: RunState, group, slots) -> tuple[RunState, WorkerError | None]:
        """Train `group` on `slots`, after the cluster check (`keep_off`) and the storage check of
        their nodes not checked yet. A failure comes back with the run state as far as it got (the
        nodes it checked)."""
        try:
            run, slots = self.keep_off(run, group, slots)
            run = self.ledger.check_storage(run, group, slots)
            run = self.ledger.advance(run)  # a new generation, published before its ranks join
            group.rebuild(list(slots), run.generation)
        except WorkerError as err:
            return run, err
        return run, None

    def keep_off(self, run: RunState, group, slots) -> tuple[RunState, tuple[int, ...]]:
        """The nodes of `slots` the run has not used yet get the cluster check; the replicas placed
        on one that fails it for good (another torch or rayhybrid: Ray drains it) move elsewhere
        before any rank starts there, as off a drained node: waited for (elastic: the run goes on
        without those not placed in time). Raises RunFailed when too few are left."""
        for _ in range(3):  # a node Ray would not drain may hold a replica again: give up after three tries
            bad = self.joins.refused(group.nodes_of(list(slots))) if self.joins is not None else frozenset()
            if not bad:
                return run, tuple(slots)
            moving = slots_on(group, slots, bad)
            run = move_off(run, group, moving, bad)
            lost = group.wait_placed(moving, self.placement_wait_s)
            slots, before = tuple(self.scaling.on_loss(list(slots), lost)), len(slots)
            if not slots:
                why = why_not_placed(self.scaling, before, lost, self.placement_wait_s)
                raise RunFailed(f"{why}; {self.ledger.last_good()}")
            if len(slots) < before:  # elastic: a grow onto the node is cancelled, a recovery shrinks
                log.warning(
                    "cluster check: %d replica(s) not placed off node(s) %s within %.0fs; the run goes on at dp %d",
                    before - len(slots),
                    ", ".join(sorted(n[:8] for n in bad)),
                    self.placement_wait_s,
                    len(slots),
                )
        raise RunFailed(f"cluster.check: replicas kept landing on node(s) {sorted(n[:8] for n in bad)} it refused")

    def replace(self, run: RunState, group, drained: Drained) -> tuple[RunState, tuple[int, ...], str | None]:
        """After a failure's teardown: wait for the broken replicas to be placed again
        (elsewhere, if their node is being drained). The run state, the slots the scaling
        policy keeps, and why there are none (None when there are)."""
        draining = self.drains.draining()
        moving = slots_on(group, drained.broken, draining)
        if moving:  # replicas that lost workers on a node being drained go elsewhere
            run = move_off(run, group, moving, draining)
        lost = group.wait_placed(drained.broken, self.placement_wait_s)
        slots = tuple(self.scaling.on_loss(list(group.slots), lost))
        return run, slots, None if slots else why_not_placed(self.scaling, group.dp, lost, self.placement_wait_s)

    @property
    def placement_wait_s(self) -> float:
        """How long replicas placed again are waited for: elastic.reschedule_timeout_s in an
        elastic run (it goes on without them), cluster.placement_timeout_s in a fixed-size one."""
        return self.cfg.elastic.reschedule_timeout_s if self.scaling.elastic else self.cfg.cluster.placement_timeout_s

    def restore(
        self, run: RunState, group, intr: Interruption | None, heal: bool = False
    ) -> tuple[RunState, Interruption | None]:
        """After a failure (`heal`), heal from the survivors' state when the heal policy says
        so, else load the latest checkpoint into the group (if any); describe the workers."""
        latest = self.found if run.first_restore is None else self.ledger.latest()
        healed = self.healing.heal(run, group, intr, latest) if heal else None
        if healed is not None:
            run, intr, finished = healed
            run = self.ledger.saved(run, finished)
        else:
            run, intr = self.ledger.restore(run, group, intr, latest)
        self.log.workers(
            with_dp(self.cfg, group.dp), group.placement(), [i.pid for i in group.infos], group.descriptions[0]
        )
        return run, intr


def move_off(run: RunState, group, moving: list[int], nodes) -> RunState:
    """The replicas of the slots `moving` placed again, off `nodes` (drained, or refused by the
    cluster check), which the run counts as left (`RunState.evacuated`)."""
    group.replace(moving)
    return run.but(evacuated=run.evacuated | nodes)
