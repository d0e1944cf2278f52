"""Peer healing, the driver's side (`fault.heal`): after a failure and the rebuild, ask what each
worker kept, let the heal policy choose between the peers and the checkpoint, and run the
transfer. The workers' side is rayhybrid/trainer/heal.py; docs/recovery-and-elasticity.md
says what is kept, when and at what cost.

    healing = Healing(cfg, runlog)
    healed = healing.heal(run, intr, latest)   # (run, intr) at the healed step, or None
"""

from __future__ import annotations

import logging
import time

from rayhybrid.cluster.heal import heal, held
from rayhybrid.config.schema import Config
from rayhybrid.driver.policies import HealPlan, HealPolicy
from rayhybrid.driver.records import Interruption
from rayhybrid.driver.runlog import RunLog
from rayhybrid.driver.state import RunState

log = logging.getLogger("rayhybrid")


class Healing:
    def __init__(self, cfg: Config, runlog: RunLog) -> None:
        self.policy = HealPolicy(cfg.fault.heal)
        self.log = runlog

    def heal(self, run: RunState, intr: Interruption, latest) -> tuple[RunState, Interruption, list[dict]] | None:
        """Heal the rebuilt group from the state its survivors kept, when the policy says so:
        the run state at the healed step, the interruption with its figures, and the saves
        that the step the driver never had reported. None: restore `latest` instead."""
        group = run.group
        topo = group.layout.topology
        kept = held(group)
        copies: dict[tuple[int, int], list] = {}
        for rank, k in enumerate(kept):
            c = topo.coord(rank)
            copies.setdefault((c.pp, c.tp), [None] * topo.dp)[c.dp] = k["step"] if k else None
        plan = self.policy.choose(copies, latest.step if latest is not None else None)
        if plan is None:
            why = "no rank kept its state" if not any(kept) else "a shard has no live copy of the newest step"
            log.info("healing from peers is not possible (%s): restoring the checkpoint", why)
            return None
        log.info("healing %d rank(s) from their data-parallel peers at step %d", plan.transfers, plan.step)
        sources = _by_rank(topo, plan)
        mark = time.perf_counter()
        done = heal(group, sources)
        sent = sum(r["bytes"] for rank, r in enumerate(done) if rank not in sources)  # what the senders sent
        took = time.perf_counter() - mark
        log.info("healed: %.1f MB sent in %.2fs", sent / 1e6, took)
        finished = []
        record = next((k["metrics"] for k in kept if k and k["step"] == plan.step and k["metrics"]), None)
        if plan.step > run.step and record is not None:  # ranks that passed the last vote stepped
            finished = record.pop("checkpoints", [])
            self.log.step(record)
        intr = intr.but(
            healed="peer", steps_redone=0, bytes_sent=sent, restore_s=intr.restore_s + took, resume_step=plan.step
        )
        self.log.event({"event": "heal", "step": plan.step, "ranks": sorted(sources), "bytes": sent})
        return run.but(step=plan.step, uploading=False), intr, finished


def _by_rank(topo, plan: HealPlan) -> dict[int, int]:
    """receiving rank -> sending rank, in the new world's ranks."""
    return {
        topo.rank(dp=d, pp=pp, tp=tp): topo.rank(dp=src, pp=pp, tp=tp)
        for (pp, tp), receivers in plan.sources.items()
        for d, src in receivers.items()
    }
