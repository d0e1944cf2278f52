"""Finding the largest micro-batch that fits memory in a handful of trials.

Peak memory of every rank, stage and phase (forward, backward, optimizer step) is, to a very good
approximation, a fixed part (parameters, gradients, optimizer state, buffers) plus a part per
sample of the micro-batch (saved activations, pipeline buffers; a 1F1B schedule keeps at most
`pp - stage` micro-batches in flight, GPipe all of them, but for a fixed schedule and number of
micro-batches that is still linear in the micro-batch size). So:

1. probe two micro-batch sizes and fit `fixed + per_sample * m` for each (rank, stage, phase).
   The probes are best placed near the answer: `python -m rayhybrid.tune` puts them at the
   planner's predicted largest size and half of it (rayhybrid/tune/space.py), so the line is
   fitted where it is used; without a planner they are 1 and 2;
2. predict the largest `m` whose highest predicted peak stays under the budget less a safety
   margin, and verify it with one trial (a prediction far beyond the sizes measured is approached
   in RAMP-fold steps first);
3. when it fits, refit the line through it and step once to the largest size the line puts under
   the whole budget (the margin's worth, without crawling up one size per trial);
4. on a miss (out of memory, or over budget), step inside the gap with the refitted line, or
   bisect, until the largest fit is within TOLERANCE of the smallest miss.

Three trials with planner-placed probes, four or five from 1 and 2; the answer is the largest
size that fits, or within TOLERANCE of it.

`MicroBatchSearch` is that procedure, free of Ray so it can be tested against synthetic memory
oracles; `PlanSearcher` (ray_searcher.py) drives a whole `TunePlan` (microbatch.py) from a Ray Tune search.

    search = MicroBatchSearch(budget_mb=16_000)
    while (m := search.next()) is not None:
        peaks, oom = run_trial(micro_batch_size=m)   # {"rank0/stage0/backward": 9120.5, ...}
        search.observe(m, peaks, oom)
    search.best, search.trials, search.predicted_peak_mb(search.best)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Trial:
    micro_batch_size: int
    peaks_mb: dict[str, float]  # (rank, stage, phase) key -> peak MB; empty when unknown
    oom: bool

    def fits(self, budget_mb: float) -> bool:
        return not self.oom and max(self.peaks_mb.values(), default=0.0) <= budget_mb


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """`(a, b)` of `y = a + b x` by least squares, the slope held at 0 or more (memory and time
    only grow with the micro-batch); one distinct x gives a flat line through the mean."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = max(sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0, 0.0)
    return mean_y - slope * mean_x, slope


@dataclass
class LinearMemoryModel:
    """`peak(m) = fixed + per_sample * m` for each key, least squares over the trials that have
    figures (two give an exact line)."""

    fixed: dict[str, float] = field(default_factory=dict)
    per_sample: dict[str, float] = field(default_factory=dict)

    @classmethod
    def fit(cls, trials: list[Trial]) -> LinearMemoryModel:
        measured = [t for t in trials if t.peaks_mb]
        sizes = sorted({t.micro_batch_size for t in measured})
        if len(sizes) < 2:
            raise ValueError("fitting memory needs figures at two micro-batch sizes")
        model = cls()
        for key in set().union(*(t.peaks_mb for t in measured)):
            points = [(t.micro_batch_size, t.peaks_mb[key]) for t in measured if key in t.peaks_mb]
            model.fixed[key], model.per_sample[key] = fit_line(points)
        return model

    def predict(self, m: int) -> dict[str, float]:
        return {key: self.fixed[key] + self.per_sample[key] * m for key in self.fixed}

    def peak(self, m: int) -> float:
        return max(self.predict(m).values())

    def largest_under(self, limit_mb: float, cap: int) -> int:
        """The largest m in [1, cap] whose highest predicted peak is at most `limit_mb` (0 if
        none)."""
        best = cap
        for key, slope in self.per_sample.items():
            room = limit_mb - self.fixed[key]
            if room < slope:  # not even one sample
                return 0
            if slope > 0:
                best = min(best, int(room // slope))
        return max(best, 0)


TOLERANCE = 0.03
"""A search stops once its largest fit is within this fraction of the largest size not yet ruled
out: the last few percent are not worth a trial each."""

RAMP = 16
"""A prediction more than this many times the largest size measured is approached by measuring
that multiple first (once: when that trial measures what the line predicted for it, within
RAMP_AGREEMENT, the line holds and the prediction is tried next)."""
RAMP_AGREEMENT = 0.05


class MicroBatchSearch:
    """Probe two sizes, fit, predict, verify, step to the edge, bisect on a miss (see the module
    docstring). `candidates`: the sizes allowed (sorted; None: every size up to
    `max_micro_batch`), e.g. the divisors of a fixed global batch per replica."""

    def __init__(
        self,
        budget_mb: float,
        probes: tuple[int, int] = (1, 2),
        margin: float = 0.01,
        max_micro_batch: int = 1 << 16,
        candidates: list[int] | tuple[int, ...] | None = None,
        tolerance: float = TOLERANCE,
    ) -> None:
        if not 0 < probes[0] < probes[1]:
            raise ValueError(f"probes must be two increasing positive sizes, got {probes}")
        self.budget_mb = budget_mb
        self.margin = margin
        self.tolerance = tolerance
        self.max_micro_batch = max_micro_batch
        self.candidates = sorted(set(candidates)) if candidates is not None else None
        if self.candidates is not None and not self.candidates:
            raise ValueError("no candidate micro-batch sizes")
        self.probes = self._snap_probes(probes)
        self.trials: list[Trial] = []
        self.model: LinearMemoryModel | None = None
        self.prediction: int | None = None
        self._edge_tried = False
        self._ramp: tuple[int, float] | None = None  # the last RAMP step and the peak the line gave it
        self._line_confirmed = False  # a RAMP step measured what the line predicted: no more ramps
        self._next: int | None = self.probes[0]

    # -- the two calls a driver makes ---------------------------------------------------------

    def next(self) -> int | None:
        """The micro-batch size to try next; None when the search is done."""
        return self._next

    def observe(self, micro_batch_size: int, peaks_mb: dict[str, float], oom: bool) -> None:
        if micro_batch_size != self._next:
            raise ValueError(f"expected a result for micro-batch {self._next}, got {micro_batch_size}")
        self.trials.append(Trial(micro_batch_size, dict(peaks_mb), bool(oom)))
        self._next = self._decide()

    # -- results ------------------------------------------------------------------------------

    @property
    def best(self) -> int | None:
        """The largest micro-batch size that was run and fitted (None if none did)."""
        fitting = [t.micro_batch_size for t in self.trials if t.fits(self.budget_mb)]
        return max(fitting, default=None)

    @property
    def done(self) -> bool:
        return self._next is None

    def predicted_peak_mb(self, micro_batch_size: int) -> float | None:
        return None if self.model is None else self.model.peak(micro_batch_size)

    # -- the sizes allowed --------------------------------------------------------------------

    def _floor(self, m: int) -> int:
        """The largest allowed size <= m (0: none)."""
        m = min(m, self.max_micro_batch)
        if self.candidates is None:
            return max(m, 0)
        return max((c for c in self.candidates if c <= m), default=0)

    def _between(self, lo: int, hi: int) -> range | list[int]:
        """The allowed sizes strictly between lo and hi."""
        if self.candidates is None:
            return range(lo + 1, min(hi, self.max_micro_batch + 1))
        return [c for c in self.candidates if lo < c < hi]

    def _snap_probes(self, probes: tuple[int, int]) -> tuple[int, int]:
        if self.candidates is None:
            return min(probes[0], self.max_micro_batch - 1), min(probes[1], self.max_micro_batch)
        first = self._floor(probes[0]) or self.candidates[0]
        second = self._floor(probes[1])
        if second <= first:
            second = next((c for c in self.candidates if c > first), first)
        return first, second

    # -- the procedure ------------------------------------------------------------------------

    def _decide(self) -> int | None:
        fitted = [t.micro_batch_size for t in self.trials if t.fits(self.budget_mb)]
        missed = [t.micro_batch_size for t in self.trials if not t.fits(self.budget_mb)]
        tried = {t.micro_batch_size for t in self.trials}
        lo = max(fitted, default=0)
        hi = min((m for m in missed if m > lo), default=None)
        if not fitted:
            return self._below_the_smallest_miss(min(missed), tried)
        if hi is None and self.probes[1] not in tried and self.probes[1] > lo:
            return self.probes[1]
        self._refit()
        self._settle_ramp()
        if hi is None:
            return self._beyond_the_largest_fit(lo, tried)
        return self._inside_the_gap(lo, hi, tried)

    def _below_the_smallest_miss(self, smallest_miss: int, tried: set[int]) -> int | None:
        """Nothing fits yet (the probes were placed too high): halve below the smallest miss."""
        below = self._between(0, smallest_miss)
        if not below:
            return None  # the smallest size does not fit: no answer
        half = self._floor(smallest_miss // 2) or below[0]
        return half if half not in tried else None

    def _refit(self) -> None:
        """Refit on the two largest sizes measured: memory is convex in the micro-batch (a fixed
        level can dominate small sizes, activations large ones), so the points nearest the
        answer give the line that matters there."""
        measured = sorted({t.micro_batch_size for t in self.trials if t.peaks_mb})
        if len(measured) >= 2:
            self.model = LinearMemoryModel.fit([t for t in self.trials if t.micro_batch_size in measured[-2:]])

    def _settle_ramp(self) -> None:
        """After a RAMP step: did it measure what the line predicted for it?"""
        if self._ramp is None:
            return
        ramp, expected = self._ramp
        last = self.trials[-1]
        if last.micro_batch_size == ramp and last.peaks_mb:
            measured_peak = max(last.peaks_mb.values())
            self._line_confirmed = abs(expected - measured_peak) <= RAMP_AGREEMENT * measured_peak
        self._ramp = None

    def _beyond_the_largest_fit(self, lo: int, tried: set[int]) -> int | None:
        """No miss above the largest fit `lo`: the line's prediction, then its edge."""
        if self.model is None:
            return None
        edge = self._floor(self.model.largest_under(self.budget_mb, self.max_micro_batch))
        if not self._edge_tried:
            # 1. The prediction under the margin, approached in RAMP-fold steps when far
            #    beyond anything measured (the probes may sit where a fixed level hides the
            #    activations' growth).
            prediction = self._floor(self.model.largest_under(self._limit, self.max_micro_batch))
            if prediction > lo and prediction not in tried:
                largest_measured = max(t.micro_batch_size for t in self.trials if t.peaks_mb)
                ramp = self._floor(RAMP * largest_measured)
                if prediction > ramp > lo and ramp not in tried and not self._line_confirmed:
                    self._ramp = (ramp, self.model.peak(ramp))
                    return ramp
                self.prediction = prediction
                return prediction
        # 2. It fitted: the line refitted through it is exact near the edge, so step to the
        #    largest size it puts under the whole budget (the margin's worth at once, not
        #    one size per trial); after that, only a step of more than TOLERANCE is worth it.
        if edge <= lo or edge in tried or (self._edge_tried and lo >= (1 - self.tolerance) * edge):
            return None
        self._edge_tried = True
        self.prediction = edge
        return edge

    def _inside_the_gap(self, lo: int, hi: int, tried: set[int]) -> int | None:
        """A miss `hi` above the largest fit `lo`: done when no size between them is worth a
        trial."""
        between = self._between(lo, hi)
        if not between or lo >= (1 - self.tolerance) * between[-1]:
            return None
        # The refitted line predicts inside the gap (a secant step), under the margin first;
        # otherwise (no line, or one that points past the miss) bisect.
        if self.model is not None:
            for cap in (self._limit, self.budget_mb):
                prediction = self._floor(self.model.largest_under(cap, self.max_micro_batch))
                if lo < prediction < hi and prediction not in tried:
                    self.prediction = prediction
                    return prediction
            if prediction <= lo:
                return between[0]  # the line puts the edge at the largest fit: check the next size
        return between[(len(between) - 1) // 2]  # nothing between lo and hi was tried

    @property
    def _limit(self) -> float:
        """The budget less the safety margin: where predictions aim."""
        return self.budget_mb * (1 - self.margin)
