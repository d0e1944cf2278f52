"""The whole tuning plan, free of Ray: memory first, then throughput on the feasible frontier.

1. **Memory**, for each `train.activation_checkpointing` setting asked for: a `MicroBatchSearch`
   at `n0` micro-batches per step (the fewest a pipeline fills with: `pp`). Under 1F1B a stage
   holds at most `pp - stage` micro-batches whatever their number, so the largest micro-batch
   `M` found there fits any larger number too; GPipe holds all of them, and the throughput
   trials below measure what they hold.
2. **Throughput**, for each setting with an `M`: the memory search's own trial at `(M, n0)`, plus
   `(M, 2 n0)` (a smaller pipeline bubble, a larger global batch) and `(M / 2, 2 n0)` (the same
   global batch in smaller pieces). A trial that runs out of memory is recorded, not fatal.

The fastest trial that fitted the budget wins (`best`).

    plan = TunePlan(budget_mb=16_000, n0=4)
    while (point := plan.next()) is not None:
        plan.observe(point, run_trial(point))    # {"oom": 0, "tokens_per_s": ..., "peak_mb/<key>": ...}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayhybrid.tune.search import PEAK_PREFIX, MicroBatchSearch


@dataclass(frozen=True)
class Point:
    micro_batch_size: int
    num_microbatches: int
    activation_checkpointing: bool

    def as_config(self, purpose: str) -> dict:
        return {
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "activation_checkpointing": self.activation_checkpointing,
            "purpose": purpose,
        }


@dataclass
class Record:
    """One trial: where it ran, why, and what it measured."""

    point: Point
    purpose: str  # "memory" or "throughput"
    oom: bool
    peaks_mb: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    error: str = ""
    predicted_peak_mb: float | None = None

    @property
    def peak_mb(self) -> float:
        return max(self.peaks_mb.values(), default=0.0)

    def fits(self, budget_mb: float) -> bool:
        return not self.oom and not self.error and bool(self.peaks_mb) and self.peak_mb <= budget_mb


def peaks_from_result(result: dict) -> dict[str, float]:
    return {k[len(PEAK_PREFIX) :]: float(v) for k, v in result.items() if k.startswith(PEAK_PREFIX)}


class TunePlan:
    def __init__(
        self,
        budget_mb: float,
        n0: int = 1,
        activation_checkpointing: tuple[bool, ...] = (False, True),
        probes: tuple[int, int] = (1, 2),
        margin: float = 0.01,
        max_micro_batch: int = 4096,
    ) -> None:
        if not activation_checkpointing:
            raise ValueError("tune.activation_checkpointing needs at least one setting")
        self.budget_mb = budget_mb
        self.n0 = n0
        self.searches = {
            bool(ac): MicroBatchSearch(budget_mb, tuple(probes), margin, max_micro_batch)
            for ac in dict.fromkeys(activation_checkpointing)
        }
        self.records: list[Record] = []
        self._throughput: list[Point] | None = None
        self._pending: tuple[Point, str] | None = None

    def next(self) -> dict | None:
        """The next trial's settings (`Point` fields and `purpose`), or None when done."""
        if self._pending is not None:
            raise RuntimeError("observe the running trial first")
        for ac, search in self.searches.items():
            m = search.next()
            if m is not None:
                return self._start(Point(m, self.n0, ac), "memory")
        if self._throughput is None:
            self._throughput = self._frontier()
        measured = {r.point for r in self.records}
        for point in self._throughput:
            if point not in measured:
                return self._start(point, "throughput")
        return None

    def _start(self, point: Point, purpose: str) -> dict:
        self._pending = (point, purpose)
        return point.as_config(purpose)

    def observe(self, config: dict, result: dict | None, error: bool = False) -> Record:
        """Record a trial's result (`oom`, `tokens_per_s`, `peak_mb/<key>` entries, `error`); a
        trial that crashed (`error=True`) fitted nothing."""
        point, purpose = self._pending or (None, None)
        if point is None or point.as_config(purpose) != config:
            raise ValueError(f"expected a result for {self._pending}, got {config}")
        self._pending = None
        result = result or {}
        message = str(result.get("error") or ("the trial crashed" if error else ""))
        search = self.searches[point.activation_checkpointing]
        record = Record(
            point,
            purpose,
            oom=bool(result.get("oom", 0)),
            peaks_mb=peaks_from_result(result),
            tokens_per_s=float(result.get("tokens_per_s") or 0.0),
            error=message,
            predicted_peak_mb=search.predicted_peak_mb(point.micro_batch_size)
            if point.num_microbatches == self.n0
            else None,
        )
        self.records.append(record)
        if purpose == "memory":
            # An error that is not out of memory still tells the search this size is no good.
            search.observe(point.micro_batch_size, record.peaks_mb, record.oom or bool(message))
        return record

    def _frontier(self) -> list[Point]:
        points = []
        for ac, search in self.searches.items():
            m = search.best
            if m is None:
                continue
            points += [Point(m, self.n0, ac), Point(m, 2 * self.n0, ac)]
            if m >= 2:
                points.append(Point(m // 2, 2 * self.n0, ac))
        return list(dict.fromkeys(points))

    # -- results ------------------------------------------------------------------------------

    def largest_micro_batch(self, activation_checkpointing: bool = False) -> int | None:
        search = self.searches.get(activation_checkpointing)
        return None if search is None else search.best

    def memory_trials(self, activation_checkpointing: bool = False) -> int:
        """Trials the memory search took for this setting."""
        return len(self.searches[activation_checkpointing].trials)

    @property
    def best(self) -> Record | None:
        """The fastest trial that fitted the budget."""
        fitting = [r for r in self.records if r.fits(self.budget_mb)]
        return max(fitting, key=lambda r: r.tokens_per_s, default=None)
