"""`tune.search=micro_batch`: the batch shape on the topology given, free of Ray (`TunePlan`):
memory first, then throughput on the feasible frontier.

1. **Memory**, for each `train.activation_checkpointing` setting asked for: a `MicroBatchSearch`
   (memory_search.py). With a free global batch it runs at `n0` micro-batches per step (the fewest a
   pipeline fills with: `pp`): under 1F1B a stage holds at most `pp - stage` micro-batches
   whatever their number, so the largest micro-batch `M` found there fits any larger number too;
   GPipe holds all of them, and the throughput trials below measure what they hold. With a fixed
   global batch (`per_replica` = G / dp samples per replica) every trial is a way to train that
   batch: micro-batch `m` among the sizes that divide it (`candidates`), `per_replica / m`
   micro-batches.
2. **Throughput**, for each setting with an `M`:
   - free global batch: the memory search's own trial at `(M, n0)`, plus `(M, 2 n0)` (a smaller
     pipeline bubble, a larger global batch) and `(M / 2, 2 n0)` (the same global batch in
     smaller pieces);
   - fixed global batch: fewer, larger micro-batches cost less per sample but leave a larger
     pipeline bubble. The trials so far fit a step time `n / (1 - bubble(n)) * (c0 + c1 m)`
     (per-micro-batch overhead `c0`, per-sample work `c1`); up to `extra` sizes that fit, not
     yet run, that it puts within SLACK of the fastest run, are timed.
   A point the planner puts over the budget is not run (1F1B keeps a receive buffer per
   micro-batch, so more micro-batches can need more memory); a trial that runs out of memory
   is recorded, not fatal.

The fastest trial that fitted the budget wins (`best`), by `metric`: `tokens_per_s` (wall time)
on GPUs, `tokens_per_cpu_s` (the busiest rank's CPU time) on CPU, where ranks share cores.

    plan = TunePlan(budget_mb=16_000, n0=4)
    while (point := plan.next()) is not None:
        plan.observe(point, run_trial(point))    # {"oom": 0, "tokens_per_s": ..., "peak_mb/<key>": ...}
"""

from __future__ import annotations

from collections.abc import Callable

from rayhybrid.tune.memory_search import MicroBatchSearch, fit_line
from rayhybrid.tune.trials import Point, Record, fastest, record_of

SLACK = 0.1
"""A fixed global batch's size not run yet is timed when the fitted step time puts it within this
fraction of the fastest size run (the fit is rough: two or three points)."""


def fit_step_time(records: list[Record], bubble: Callable[[int], float], metric: str) -> tuple[float, float] | None:
    """`(c0, c1)` of a micro-batch's time `c0 + c1 m`, least squares over the records' step
    times `n / (1 - bubble(n)) * (c0 + c1 m)`; None without two sizes."""
    points = [
        (
            r.point.micro_batch_size,
            r.seconds(metric) * (1 - bubble(r.point.num_microbatches)) / r.point.num_microbatches,
        )
        for r in records
        if r.seconds(metric) > 0
    ]
    if len({m for m, _ in points}) < 2:
        return None
    c0, c1 = fit_line(points)
    return max(c0, 0.0), c1


class TunePlan:
    def __init__(
        self,
        budget_mb: float,
        n0: int = 1,
        activation_checkpointing: tuple[bool, ...] = (False, True),
        probes: tuple[int, int] | dict[bool, tuple[int, int]] = (1, 2),
        margin: float = 0.01,
        max_micro_batch: int = 4096,
        per_replica: int = 0,
        candidates: dict[bool, list[int]] | None = None,
        bubble: Callable[[int], float] | None = None,
        planner: Callable[[Point], float | None] | None = None,
        metric: str = "tokens_per_s",
        extra: int = 2,
    ) -> None:
        if not activation_checkpointing:
            raise ValueError("tune.activation_checkpointing needs at least one setting")
        if per_replica and candidates is None:
            raise ValueError("a fixed global batch needs the candidate micro-batch sizes")
        self.budget_mb = budget_mb
        self.n0 = n0
        self.per_replica = per_replica
        self.bubble = bubble or (lambda n: 0.0)
        self.planner = planner
        self._planned: dict[Point, float | None] = {}  # the planner's peak per point asked about
        self.metric = metric
        self.extra = extra
        settings = [bool(ac) for ac in dict.fromkeys(activation_checkpointing)]
        if per_replica:
            settings = [ac for ac in settings if candidates.get(ac)]
        self.searches = {
            ac: MicroBatchSearch(
                budget_mb,
                tuple(probes[ac] if isinstance(probes, dict) else probes),
                margin,
                max_micro_batch,
                candidates=candidates[ac] if per_replica else None,
            )
            for ac in settings
        }
        self.records: list[Record] = []
        self._throughput: list[Point] | None = None
        self.skipped: list[tuple[Point, float]] = []  # throughput points the planner put over budget
        self._pending: tuple[Point, str] | None = None

    def num_microbatches(self, m: int) -> int:
        return self.per_replica // m if self.per_replica else self.n0

    def next(self) -> dict | None:
        """The next trial's settings (`Point` fields and `purpose`), or None when done."""
        if self._pending is not None:
            raise RuntimeError("observe the running trial first")
        for ac, search in self.searches.items():
            m = search.next()
            if m is not None:
                return self._start(Point(m, self.num_microbatches(m), ac), "memory")
        measured = {r.point for r in self.records}
        if self._throughput is None:
            self._throughput = [p for p in self._frontier() if p in measured or not self._planned_over(p)]
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
        search = self.searches[point.activation_checkpointing]
        on_line = point.num_microbatches == self.num_microbatches(point.micro_batch_size)
        record = record_of(
            point,
            purpose,
            result,
            error,
            predicted_peak_mb=search.predicted_peak_mb(point.micro_batch_size) if on_line else None,
            planned_mb=self.planned_mb(point),
        )
        self.records.append(record)
        if purpose == "memory":
            # An error that is not out of memory still tells the search this size is no good.
            search.observe(point.micro_batch_size, record.peaks_mb, record.oom or bool(record.error))
        return record

    def planned_mb(self, point: Point) -> float | None:
        """The planner's peak for `point` (None without a planner), asked once per point."""
        if self.planner is None:
            return None
        if point not in self._planned:
            self._planned[point] = self.planner(point)
        return self._planned[point]

    def _planned_over(self, point: Point) -> bool:
        """The planner puts this throughput point over the budget: no trial is spent on it."""
        planned = self.planned_mb(point)
        if planned is not None and planned > self.budget_mb:
            self.skipped.append((point, planned))
            return True
        return False

    def _frontier(self) -> list[Point]:
        points = []
        for ac, search in self.searches.items():
            m = search.best
            if m is None:
                continue
            if self.per_replica:
                points += self._fastest_sizes(ac, m)
                continue
            points += [Point(m, self.n0, ac), Point(m, 2 * self.n0, ac)]
            if m >= 2:
                points.append(Point(m // 2, 2 * self.n0, ac))
        return list(dict.fromkeys(points))

    def _fastest_sizes(self, ac: bool, largest: int) -> list[Point]:
        """Fixed global batch: the `extra` sizes up to `largest` (which fitted), not run yet, that
        the fitted step time puts faster than (or within SLACK of) the fastest size run."""
        search = self.searches[ac]
        timed = [r for r in self.records if r.point.activation_checkpointing == ac and r.fits(self.budget_mb)]
        run = {r.point.micro_batch_size for r in self.records if r.point.activation_checkpointing == ac}
        sizes = [m for m in search.candidates if m <= largest and m not in run]
        fit = fit_step_time(timed, self.bubble, self.metric)
        if fit is None:
            # One size timed: without a pipeline the largest is fastest (fewest micro-batches, no
            # bubble to shrink); in one, try the next smaller sizes (a smaller bubble).
            ranked = sorted(sizes, reverse=True) if self.bubble(1) > 0 else []
            return [Point(m, self.num_microbatches(m), ac) for m in ranked][: self.extra]
        c0, c1 = fit

        def step(m: int) -> float:
            n = self.num_microbatches(m)
            return n / (1 - self.bubble(n)) * (c0 + c1 * m)

        fastest_run = min(step(r.point.micro_batch_size) for r in timed)
        promising = sorted((m for m in sizes if step(m) <= (1 + SLACK) * fastest_run), key=step)
        return [Point(m, self.num_microbatches(m), ac) for m in promising][: self.extra]

    # -- results ------------------------------------------------------------------------------

    def largest_micro_batch(self, activation_checkpointing: bool = False) -> int | None:
        search = self.searches.get(activation_checkpointing)
        return None if search is None else search.best

    def memory_trials(self, activation_checkpointing: bool = False) -> int:
        """Trials the memory search took for this setting."""
        return len(self.searches[activation_checkpointing].trials)

    @property
    def best(self) -> Record | None:
        """The fastest trial that fitted the budget (by `metric`)."""
        return fastest(self.records, self.budget_mb, self.metric)
