"""fault.heal on one worker: the state it kept across a failure, and the transfers that give
the new ranks their state (rayhybrid/trainer/heal.py does the keeping and the sending; the
driver decides who sends to whom, rayhybrid/driver/healing.py)."""

from __future__ import annotations

import logging
import time

from rayhybrid.trainer.results import HealResult, HeldState

log = logging.getLogger("rayhybrid")


class Healer:
    """What a `TrainWorker` kept across a failure (`kept`, a `trainer.heal.Kept`, or None) and
    what it does with it. The worker keeps its trainer; each call is given the one it has now."""

    def __init__(self) -> None:
        self.kept = None

    def keep(self, trainer, rank: int) -> None:
        """Keep `trainer`'s state (a whole step's); on failure keep nothing, and the run
        restores a checkpoint instead."""
        from rayhybrid.trainer.heal import keep

        try:
            self.kept = keep(trainer)
        except Exception as err:  # noqa: BLE001 - nothing kept: the run restores a checkpoint
            log.warning("rank %d kept no state for healing: %s", rank, err)
            self.kept = None

    def forget(self) -> None:
        """Drop what was kept (the run goes back to a checkpoint, or the worker closes)."""
        self.kept = None

    def held(self, trainer) -> HeldState | None:
        """The step kept, if its shards are the ones `trainer` holds, and whether it has that
        step's results ("recorded"); None when nothing usable was kept."""
        from rayhybrid.trainer.heal import shape_of

        kept = self.kept
        if kept is None or trainer is None or kept.shape != shape_of(trainer):
            return None
        return HeldState(kept.step, kept.nbytes, kept.record is not None)

    def heal(self, trainer, src: int | None, receivers: list[int]) -> HealResult:
        """Give `trainer` the state the run heals to: the kept one (`src` None), sent on to
        `receivers`, or rank `src`'s over the network. Returns the step it now holds, this
        rank's record of that step (`step_record`), the bytes moved and the seconds taken
        (`HealResult`)."""
        from rayhybrid.trainer import heal

        start = time.perf_counter()
        if src is None:
            heal.restore(trainer, self.kept)
            moved = heal.send(trainer, receivers) if receivers else 0
            kept = self.kept.record
        else:  # what it kept is replaced, and so are its results
            moved, kept = heal.receive(trainer, src), None
        self.kept = None
        record = heal.step_record(trainer, kept)
        return HealResult(trainer.step, record, moved, time.perf_counter() - start)

    @staticmethod
    def trace(trainer, step: int, ranges: list[list[int]]) -> list[dict]:
        """data.trace: the rows of the samples in `ranges` ([start, count]) read in step `step`.
        Where a sample came from is a function of the data, the seed and the sample, so any
        rank gives the rows of a replica lost with its step (a shrink that healed forward)."""
        from rayhybrid.data.streams import Shard, trace_rows

        return [row for start, count in ranges for row in trace_rows(trainer.stream, step, Shard(start, count))]
