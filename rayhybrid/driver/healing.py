"""Peer healing, the driver's side (`fault.heal`): after a failure and the rebuild, ask what each
worker kept, let the heal policy choose between the peers and the checkpoint, and run the
transfer. The workers' side is rayhybrid/trainer/heal.py; docs/recovery-and-elasticity.md
says what is kept, when and at what cost.

    healing = Healing(cfg, runlog)
    healed = healing.heal(run, group, intr, latest)   # (run, intr, saves) at the healed step, or None
"""

from __future__ import annotations

import logging
import time

from rayhybrid.cluster.merge import merge_steps
from rayhybrid.config.schema import Config
from rayhybrid.config.topology import shard_group_size
from rayhybrid.driver.policies import HealPlan, HealPolicy
from rayhybrid.driver.records import Interruption, steps_redone
from rayhybrid.driver.runlog import RunLog
from rayhybrid.driver.state import RunState
from rayhybrid.driver.wallclock import HEALED_FORWARD
from rayhybrid.trainer.results import HealResult, HeldState, SaveResult, StepMetrics, StepResult

log = logging.getLogger("rayhybrid")


class Healing:
    def __init__(self, cfg: Config, runlog: RunLog) -> None:
        self.policy = HealPolicy(cfg.fault.heal)
        self.dp_shard = cfg.topology.dp_shard
        self.log = runlog

    def heal(
        self, run: RunState, group, intr: Interruption, latest
    ) -> tuple[RunState, Interruption, list[SaveResult]] | None:
        """Heal the rebuilt `group` from the state its survivors kept, when the policy says so:
        the run state at the healed step, the interruption with its figures, and the saves
        that the step the driver never had reported. None: restore `latest` instead."""
        topo = group.layout.topology
        kept = group.held()
        plan = self._plan(run, topo, kept, latest)
        if plan is None:
            return None
        log.info("healing %d rank(s) from their data-parallel peers at step %d", plan.transfers, plan.step)
        sources = _by_rank(topo, self._group(topo), plan)
        mark = time.perf_counter()
        done = group.heal(sources)
        sent = sum(r.nbytes for rank, r in enumerate(done) if rank not in sources)  # what the senders sent
        took = time.perf_counter() - mark
        astray = {rank: r.step for rank, r in enumerate(done) if r.step != plan.step}
        if astray:
            log.warning(
                "after healing to step %d, rank(s) %s hold step(s) %s: %s instead",
                plan.step,
                sorted(astray),
                sorted(set(astray.values())),
                "restoring the checkpoint" if latest is not None else "starting every rank afresh (no checkpoint)",
            )
            if latest is None:  # nothing to load over every rank's state: all start afresh
                group.reconfigure(group.cfg)
            return None
        log.info("healed: %.1f MB sent in %.2fs", sent / 1e6, took)
        finished = []
        if plan.step > run.step:  # ranks that passed the last vote stepped: the driver never had that step
            record = _record(group, done)
            finished = list(record.saves)
            self.log.step({**record.metrics, HEALED_FORWARD: True})  # trained before the failure (goodput)
        intr = intr.but(
            healed="peer",
            steps_redone=steps_redone(run.step, plan.step),
            bytes_sent=sent,
            restore_s=intr.restore_s + took,
            resume_step=plan.step,
        )
        self.log.event({"event": "heal", "step": plan.step, "ranks": sorted(sources), "bytes": sent})
        return run.but(step=plan.step, uploading=False), intr, finished

    def _plan(self, run: RunState, topo, kept: list[HeldState | None], latest) -> HealPlan | None:
        """The heal policy's plan for what the ranks of `topo` kept, or None (with the reason logged)."""
        n = self._group(topo)
        copies: dict[tuple[int, int, int], list] = {}
        for rank, k in enumerate(kept):
            c = topo.coord(rank)
            copies.setdefault((c.pp, c.tp, c.dp % n), [None] * (topo.dp // n))[c.dp // n] = k.step if k else None
        plan = self.policy.choose(copies, latest.step if latest is not None else None)
        if plan is None:
            why = "no rank kept its state" if not any(kept) else "a shard has no live copy of the newest step"
            log.info("healing from peers is not possible (%s): restoring the checkpoint", why)
        elif plan.step > run.step and not any(k and k.step == plan.step and k.recorded for k in kept):
            log.warning(
                "healing from peers would go on from step %d, but no rank that took it kept its results, so it "
                "could not be recorded: restoring the checkpoint",
                plan.step,
            )
            return None
        return plan

    def _group(self, topo) -> int:
        """The dp shard group size of the world `topo`: a shard is a (pp, tp, dp % N)
        coordinate, and its copies are those of the dp / N replica groups."""
        return shard_group_size(self.dp_shard, topo.dp)


def _record(group, done: list[HealResult]) -> StepResult:
    """The record of the step healed forward, by the one merge of every step from each rank's
    record of it. With data.trace, the samples of a replica lost with the step (a shrink: no
    rank of it is left) get their rows from rank 0, which can tell where any sample came from."""
    topo = group.layout.topology
    (result,) = merge_steps([[r.record] for r in done], topo.dp, topo.replica_size)
    record: StepMetrics = result.metrics
    if "data_read" in record:
        traced = {row["sample"] for rows in record["data_read"].values() for row in rows}
        lost = [r for r in record["samples"] if r[0] not in traced]
        if lost:
            record["data_read"]["0"] = [*record["data_read"].get("0", []), *group.trace(record["step"], lost)]
    return result


def _by_rank(topo, group: int, plan: HealPlan) -> dict[int, int]:
    """receiving rank -> sending rank, in the new world's ranks: replica group g of shard
    (pp, tp, s) is dp rank g * group + s."""
    return {
        topo.rank(dp=g * group + s, pp=pp, tp=tp): topo.rank(dp=src * group + s, pp=pp, tp=tp)
        for (pp, tp, s), receivers in plan.sources.items()
        for g, src in receivers.items()
    }
