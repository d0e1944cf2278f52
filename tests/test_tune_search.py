"""The micro-batch search against synthetic memory oracles: how many trials it takes, how close it
gets to the true maximum, how well it predicts peak memory, and how it handles out-of-memory."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from rayhybrid.tune.search import PEAK_PREFIX, LinearMemoryModel, MemorySearcher, MicroBatchSearch


class Oracle:
    """Peak MB per (rank, stage, phase) for a micro-batch size `m`: fixed + per-sample * m (times
    the in-flight micro-batches of a 1F1B stage), rounded up to the allocator's 2 MB blocks, plus
    an optional superlinear term. `cuda=True` reports nothing for a run that ran out of memory,
    as a real out-of-memory error would."""

    def __init__(self, rng: random.Random, budget_mb: float, pp: int = 4, superlinear: float = 0.0, cuda=False):
        self.budget_mb = budget_mb
        self.superlinear = superlinear
        self.cuda = cuda
        self.keys = {}
        for stage in range(pp):
            fixed = rng.uniform(0.15, 0.6) * budget_mb
            act = rng.uniform(0.002, 0.08) * budget_mb
            in_flight = pp - stage  # 1F1B
            self.keys[f"stage{stage}/forward"] = (fixed, act * in_flight * 0.8)
            self.keys[f"stage{stage}/backward"] = (fixed * 1.05, act * in_flight)
            self.keys[f"stage{stage}/optimizer"] = (fixed * 1.3, 0.0)
        self.runs = 0

    def peaks(self, m: int) -> dict[str, float]:
        out = {}
        for key, (fixed, per_sample) in self.keys.items():
            raw = fixed + per_sample * m + self.superlinear * per_sample * m * m
            out[key] = math.ceil(raw / 2.0) * 2.0
        return out

    def run(self, m: int) -> tuple[dict[str, float], bool]:
        self.runs += 1
        peaks = self.peaks(m)
        oom = max(peaks.values()) > self.budget_mb
        return ({} if oom and self.cuda else peaks), oom

    def true_max(self, cap: int = 1 << 16) -> int:
        m = 0
        while m + 1 <= cap and max(self.peaks(m + 1).values()) <= self.budget_mb:
            m += 1
        return m


def search(oracle: Oracle) -> MicroBatchSearch:
    s = MicroBatchSearch(budget_mb=oracle.budget_mb)
    while (m := s.next()) is not None:
        s.observe(m, *oracle.run(m))
    return s


def oracles(n: int, **kwargs) -> list[Oracle]:
    rng = random.Random(1234)
    made = []
    while len(made) < n:
        oracle = Oracle(rng, budget_mb=rng.choice([16_000, 40_000, 80_000]), pp=rng.choice([1, 2, 4, 8]), **kwargs)
        if oracle.true_max() >= 1:  # something must fit for the targets to mean anything
            made.append(oracle)
    return made


def test_targets_on_linear_oracles():
    trials, accuracy, errors = [], [], []
    for oracle in oracles(200):
        s = search(oracle)
        truth = oracle.true_max()
        trials.append(len(s.trials))
        accuracy.append(s.best / truth)
        measured = max(oracle.peaks(s.best).values())
        errors.append(abs(s.predicted_peak_mb(s.best) - measured) / measured)
        assert max(oracle.peaks(s.best).values()) <= oracle.budget_mb  # the answer fits
    assert statistics.median(trials) <= 3
    assert min(accuracy) >= 0.97
    assert max(errors) <= 0.05


def test_superlinear_memory_is_caught_by_verification_and_bisection():
    for oracle in oracles(50, superlinear=0.01):
        s = search(oracle)
        truth = oracle.true_max()
        assert s.best == truth  # a miss is bisected down to the exact answer
        # Two probes, the verification, a bisection below the prediction, one more at the top.
        assert len(s.trials) <= 3 + math.ceil(math.log2(max(s.prediction or 2, 2))) + 1


def test_out_of_memory_without_figures():
    for oracle in oracles(50, superlinear=0.02, cuda=True):
        s = search(oracle)
        assert s.best == oracle.true_max()
    # The smallest probe does not fit: the search stops at once with no answer.
    rng = random.Random(0)
    tiny = Oracle(rng, budget_mb=100.0)
    tiny.keys = {"stage0/backward": (90.0, 20.0)}
    s = search(tiny)
    assert s.done and s.best is None and len(s.trials) == 1
    # The larger probe does not fit: the answer is the smaller one, without a fit.
    tiny.keys = {"stage0/backward": (50.0, 30.0)}
    s = search(tiny)
    assert s.best == 1 and [t.micro_batch_size for t in s.trials] == [1, 2]


def test_linear_model_is_exact_on_two_points_and_predicts_the_bound():
    from rayhybrid.tune.search import Trial

    trials = [Trial(1, {"a": 150.0, "b": 320.0}, False), Trial(3, {"a": 250.0, "b": 360.0}, False)]
    model = LinearMemoryModel.fit(trials)
    assert model.fixed == pytest.approx({"a": 100.0, "b": 300.0})
    assert model.per_sample == pytest.approx({"a": 50.0, "b": 20.0})
    assert model.largest_under(1000.0, cap=1000) == 18  # a: 100 + 50*18 = 1000
    assert model.largest_under(120.0, cap=1000) == 0


def test_searcher_drives_one_trial_at_a_time_and_counts_a_crash_as_oom():
    oracle = Oracle(random.Random(7), budget_mb=10_000, pp=2)
    searcher = MemorySearcher(MicroBatchSearch(oracle.budget_mb), base_config={"steps": 3})
    first = searcher.suggest("t1")
    assert first == {"steps": 3, "micro_batch_size": 1}
    assert searcher.suggest("t2") is None  # waits for t1's result
    peaks, oom = oracle.run(1)
    searcher.on_trial_complete("t1", {"oom": int(oom), **{PEAK_PREFIX + k: v for k, v in peaks.items()}})
    second = searcher.suggest("t2")
    assert second["micro_batch_size"] == 2
    searcher.on_trial_complete("t2", None, error=True)  # the trial crashed
    assert searcher.search.best == 1
    assert searcher.suggest("t3") == MemorySearcher.FINISHED


def test_searcher_in_a_ray_tune_run(tmp_path):
    import ray
    from ray import tune

    oracle = Oracle(random.Random(11), budget_mb=40_000, pp=4)
    truth = oracle.true_max()
    # Plain data for the trial processes (they cannot import this test module).
    table = {m: oracle.run(m) for m in range(1, 4 * truth)}
    prefix = PEAK_PREFIX

    def trial(config):
        peaks, oom = table[config["micro_batch_size"]]
        tune.report({"oom": int(oom), **{prefix + k: v for k, v in peaks.items()}})

    searcher = MemorySearcher(MicroBatchSearch(oracle.budget_mb))
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        tuner = tune.Tuner(
            trial,
            tune_config=tune.TuneConfig(search_alg=searcher, num_samples=50, max_concurrent_trials=1),
            run_config=tune.RunConfig(storage_path=str(tmp_path), name="search", verbose=0),
        )
        results = tuner.fit()
    finally:
        ray.shutdown()
    sizes = [r.config["micro_batch_size"] for r in results]
    assert len(sizes) == len(searcher.search.trials) <= 4  # the search ended the run, not num_samples
    assert searcher.search.best == truth
