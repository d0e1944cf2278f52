"""Peer healing on the worker group: what each worker kept across a failure, and the transfer
that gives the new ranks their state (rayhybrid/trainer/heal.py does the sending).
`held(group)`, `heal(group, sources)` and `trace(group, step, ranges)` are the group's, kept
here beside `drain`'s.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayhybrid.trainer.results import HealResult, HeldState


def held(group) -> list[HeldState | None]:
    """Each rank's kept state, in rank order (`HeldState`: its step, its bytes, whether it kept
    that step's results), or None."""
    return group._get([w.held.remote() for w in group.workers], group.start_timeout_s, "heal")


def heal(group, sources: dict[int, int]) -> list[HealResult]:
    """Every rank in `sources` (receiver -> sender, ranks of the new world) receives its state
    from its sender; every other rank takes the state it kept and sends it to the ranks that
    name it. Returns each rank's `HealResult` (the step it now holds, its record of that step
    from `trainer.heal.step_record`, the bytes moved, the seconds)."""
    sends = defaultdict(list)
    for dst, src in sources.items():
        sends[src].append(dst)
    calls = [w.heal.remote(sources.get(rank), sorted(sends[rank])) for rank, w in enumerate(group.workers)]
    return group._get(calls, group.start_timeout_s, "heal")


def trace(group, step: int, ranges: list[list[int]]) -> list[dict]:
    """data.trace: rank 0's rows of the samples in `ranges` of step `step` (`TrainWorker.trace`)."""
    return group._get([group.workers[0].trace.remote(step, ranges)], group.start_timeout_s, "heal")[0]
