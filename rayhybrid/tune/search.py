"""Finding the largest micro-batch that fits memory in a handful of trials.

Peak memory of every rank, stage and phase (forward, backward, optimizer step) is, to a very good
approximation, a fixed part (parameters, gradients, optimizer state, buffers) plus a part per
sample of the micro-batch (saved activations, pipeline buffers; a 1F1B schedule keeps at most
`pp - stage` micro-batches in flight, GPipe all of them, but for a fixed schedule and number of
micro-batches that is still linear in the micro-batch size). So:

1. probe two micro-batch sizes and fit `fixed + per_sample * m` for each (rank, stage, phase);
2. predict the largest `m` whose highest predicted peak stays under the budget less a safety
   margin;
3. verify that prediction with one trial; only when it misses (out of memory, or over budget),
   bisect between the largest size that fitted and the one that did not. When it fits but its
   measured peaks leave room for one more sample (the margin cost a size), try that one.

`MicroBatchSearch` is that procedure, free of Ray so it can be tested against synthetic memory
oracles; `PlanSearcher` (searcher.py) drives a whole `TunePlan` (plan.py) from a Ray Tune search.

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
            n = len(points)
            mean_m = sum(m for m, _ in points) / n
            mean_y = sum(y for _, y in points) / n
            var = sum((m - mean_m) ** 2 for m, _ in points)
            slope = sum((m - mean_m) * (y - mean_y) for m, y in points) / var if var else 0.0
            model.per_sample[key] = max(slope, 0.0)
            model.fixed[key] = mean_y - model.per_sample[key] * mean_m
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


class MicroBatchSearch:
    """Probe two sizes, fit, predict, verify, bisect on a miss (see the module docstring)."""

    def __init__(
        self, budget_mb: float, probes: tuple[int, int] = (1, 2), margin: float = 0.01, max_micro_batch: int = 1 << 16
    ) -> None:
        if not 0 < probes[0] < probes[1]:
            raise ValueError(f"probes must be two increasing positive sizes, got {probes}")
        self.budget_mb = budget_mb
        self.probes = probes
        self.margin = margin
        self.max_micro_batch = max_micro_batch
        self.trials: list[Trial] = []
        self.model: LinearMemoryModel | None = None
        self.prediction: int | None = None
        self._next: int | None = probes[0]

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

    # -- the procedure ------------------------------------------------------------------------

    def _decide(self) -> int | None:
        fitted = [t.micro_batch_size for t in self.trials if t.fits(self.budget_mb)]
        missed = [t.micro_batch_size for t in self.trials if not t.fits(self.budget_mb)]
        lo = max(fitted, default=0)
        hi = min((m for m in missed if m > lo), default=None)
        if len(self.trials) == 1:
            return self.probes[1] if fitted else None  # the smallest probe does not fit: stop
        measured = sorted({t.micro_batch_size for t in self.trials if t.peaks_mb})
        if len(measured) >= 2:
            # Refit on the two largest sizes measured: memory is convex in the micro-batch
            # (a fixed level can dominate small sizes, activations large ones), so the points
            # nearest the answer give the line that matters there.
            self.model = LinearMemoryModel.fit([t for t in self.trials if t.micro_batch_size in measured[-2:]])
        limit = self.budget_mb * (1 - self.margin)
        tried = {t.micro_batch_size for t in self.trials}
        if hi is None:
            if self.model is None:
                return None
            prediction = self.model.largest_under(limit, self.max_micro_batch)
            if prediction > lo and prediction not in tried:
                ramp = RAMP * max(measured)
                if prediction > ramp:
                    # Far beyond anything measured (the probes may sit where a fixed level hides
                    # the activations' growth): measure closer first, then predict again.
                    return ramp
                self.prediction = prediction
                return prediction
            return self._one_more(lo)
        if hi - lo <= 1:
            return None
        # A miss. With figures on both sides, the refitted line predicts inside the gap (a
        # secant step); otherwise, or when it points outside, bisect.
        if self.model is not None:
            prediction = self.model.largest_under(limit, self.max_micro_batch)
            if lo < prediction < hi and prediction not in tried:
                self.prediction = prediction
                return prediction
            if prediction <= lo and lo + 1 not in tried:
                return lo + 1  # the line puts the edge just above the largest fit: check it
        return (lo + hi) // 2

    def _one_more(self, lo: int) -> int | None:
        """The margin (or allocator rounding) may have cost a size: when the largest fitting
        trial's measured peaks plus one sample's worth still fit the budget, try one more."""
        last = next(t for t in reversed(self.trials) if t.micro_batch_size == lo)
        if self.model is None or not last.peaks_mb or lo >= self.max_micro_batch:
            return None
        grown = max(v + self.model.per_sample.get(k, 0.0) for k, v in last.peaks_mb.items())
        return lo + 1 if grown <= self.budget_mb else None


RAMP = 16
"""A prediction more than this many times the largest size measured is approached by measuring
that multiple first."""

PEAK_PREFIX = "peak_mb/"  # result keys "peak_mb/<rank/stage/phase>" carry a trial's peaks
