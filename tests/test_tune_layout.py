"""The layout search (`LayoutPlan`) against the planner's own memory model, the fixed-global-batch
`TunePlan` against a linear memory oracle and a made-up step time, and the search space helpers
(space.py). Free of Ray: every trial is a function call."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import ClassVar

import pytest

from rayhybrid.config.compose import compose, to_config
from rayhybrid.plan.dry_run import host_memory_mb
from rayhybrid.tune import report, space, trials
from rayhybrid.tune.layout import STAGES_PER_RANK, LayoutPlan, factorizations, shard_options
from rayhybrid.tune.microbatch import SLACK, TunePlan
from rayhybrid.tune.trials import PEAK_PREFIX, Point

GLOBAL_BATCH = 16
BUDGET_MB = 4.5  # dp8 unsharded is planned at about 5.7 MB: the planner prunes part of the space
HEADS, LAYERS = 4, 4  # the tiny GPT's


@pytest.fixture(scope="module")
def cfg():
    return to_config(compose(["+topology=dp2_pp2_tp2"]))


@pytest.fixture(scope="module")
def cfg_pp2():
    return to_config(compose(["+topology=pp2"]))


def baseline_point(cfg) -> Point:
    """The base config as run.py's `base_point(cfg, False, micro_batch_size, layout=True)` gives it."""
    t, m = cfg.topology, cfg.train.micro_batch_size
    n = GLOBAL_BATCH // (t.dp * m)
    return Point(m, n, False, (t.dp, t.pp, t.tp, t.schedule, t.stages_per_rank, t.dp_shard))


def planned(cfg, point: dict) -> float:
    return space.planned_peak_mb(space.trial_config(cfg, point))


# -- LayoutPlan ---------------------------------------------------------------------------------


def layout_speed(favoured, schedule_bonus=None):
    """A deterministic speed: `favoured` (dp, pp, tp) three times as fast as any other layout;
    within a layout larger micro-batches a little faster, sharding and checkpointing slower, and
    `schedule_bonus` ({schedule: factor}) on top."""
    bonus = schedule_bonus or {}

    def speed(p: dict) -> float:
        s = 100.0 * (3.0 if (p["dp"], p["pp"], p["tp"]) == favoured else 1.0)
        s *= 1 + 0.05 * p["micro_batch_size"]
        s *= 0.8 if p["activation_checkpointing"] else 1.0
        s *= 0.9 if p["dp_shard"] else 1.0
        return s * bonus.get(p["schedule"], 1.0)

    return speed


class Runner:
    """Runs a layout point: the planner's peak is the 'measured' one (out of memory over the
    budget), the speed is `speed(point)`; keeps every point it ran and its planned peak."""

    def __init__(self, cfg, budget_mb: float, speed, cpu_speed=None):
        self.cfg, self.budget_mb, self.speed = cfg, budget_mb, speed
        self.cpu_speed = cpu_speed or speed
        self.ran: list[tuple[dict, float]] = []

    def __call__(self, point: dict) -> dict:
        peak = planned(self.cfg, point)
        self.ran.append((point, peak))
        oom = peak > self.budget_mb
        speed, cpu_speed = (0.0, 0.0) if oom else (self.speed(point), self.cpu_speed(point))
        return {
            "oom": int(oom),
            "tokens_per_s": speed,
            "tokens_per_cpu_s": cpu_speed,
            "step_time_s": 1000.0 / speed if speed else 0.0,
            "cpu_s": 1000.0 / cpu_speed if cpu_speed else 0.0,
            PEAK_PREFIX + "rank0/stage0/backward": peak,
        }


def drive(plan: LayoutPlan, runner: Runner) -> list[dict]:
    points = []
    while (point := plan.next()) is not None:
        points.append(point)
        plan.observe(point, runner(point))
    return points


def allowed(layout: tuple[int, int, int]) -> bool:
    """What the tiny GPT allows: tp divides its heads, every pipeline stage holds a layer."""
    _, pp, tp = layout
    return HEADS % tp == 0 and pp <= LAYERS


def test_layouts_are_the_factorizations_the_model_allows(cfg):
    plan = LayoutPlan(cfg, devices=8, devices_per_node=8, global_batch=GLOBAL_BATCH, budget_mb=1e6)
    expected = [f for f in factorizations(8, 8) if allowed(f)]
    assert sorted(plan.layouts) == sorted(expected)
    assert (1, 8, 1) not in plan.layouts and (1, 1, 8) not in plan.layouts  # 8 stages > 4 layers; tp 8 > 4 heads
    assert all(dp * pp * tp == 8 for dp, pp, tp in plan.layouts)
    # Every point that validates is planned, in a known layout, with the global batch kept.
    assert {p.layout[:3] for p in plan.planned} == set(plan.layouts)
    for p in plan.planned:
        assert p.layout[0] * p.micro_batch_size * p.num_microbatches == GLOBAL_BATCH
        assert p.layout[4] == (STAGES_PER_RANK[p.layout[3]] if p.layout[1] > 1 else 1)
    assert plan.pruned == 0 and len(plan.fitting) == len(plan.planned)  # nothing is over a huge budget

    # Tensor parallelism stays within a node: two devices per node drop every layout with tp > 2.
    two = LayoutPlan(cfg, devices=8, devices_per_node=2, global_batch=GLOBAL_BATCH, budget_mb=1e6)
    assert sorted(two.layouts) == sorted(f for f in expected if f[2] <= 2)
    assert {f for f in expected if f[2] > 2} == {(2, 1, 4), (1, 2, 4)}


def test_hsdp_is_a_candidate_only_when_dp_spans_nodes(cfg):
    """topology.dp_shard=N joins replicated and FSDP2 when a node holds N > 1 of dp's replicas
    but not all of them: shards gathered inside a node, gradients across."""
    assert shard_options(1, 2, 4, 8) == (False,)
    assert shard_options(8, 1, 1, 8) == (False, True)  # every replica on one node: FSDP2 is the group
    assert shard_options(8, 1, 1, 4) == (False, True, 4)
    assert shard_options(4, 1, 2, 4) == (False, True, 2)
    assert shard_options(4, 2, 1, 2) == (False, True)  # a replica fills a node: no group inside one
    two = LayoutPlan(cfg, devices=8, devices_per_node=4, global_batch=GLOBAL_BATCH, budget_mb=1e6)
    shards = {p.layout[5] for p in two.planned if p.layout[:3] == (8, 1, 1)}
    assert shards == {False, True, 4} and {type(s) for s in shards} == {bool, int}
    assert all(p.layout[5] in (False, True) for p in two.planned if p.layout[0] <= 2)
    hsdp = next(p for p in two.planned if p.layout[5] == 4 and not isinstance(p.layout[5], bool))
    assert hsdp.where() == "dp8 pp1 tp1 hsdp4"


@pytest.mark.parametrize("max_trials", [10, 6])
def test_layout_search_spends_no_trial_the_planner_rules_out(cfg, max_trials):
    favoured = (4, 2, 1)
    baseline = baseline_point(cfg)
    plan = LayoutPlan(cfg, 8, 8, GLOBAL_BATCH, BUDGET_MB, margin=0.01, max_trials=max_trials, baseline=baseline)
    assert planned(cfg, baseline.as_config("")) <= BUDGET_MB * 0.99  # the baseline fits: it runs
    # dp8 unsharded without checkpointing does not fit (about 5.7 MB planned), sharded does: those
    # points are pruned, not the whole layout.
    assert plan.pruned > 0 and (8, 1, 1) in plan.layouts
    dp8 = [p for p in plan.fitting if p.layout[:3] == (8, 1, 1) and not p.activation_checkpointing]
    assert dp8 and all(p.layout[5] for p in dp8)
    assert all(plan.planned[p] > BUDGET_MB * 0.99 for p in plan.planned if p not in plan.fitting)

    runner = Runner(cfg, BUDGET_MB, layout_speed(favoured))
    points = drive(plan, runner)

    # No trial over the budget less the margin, none out of memory, every prediction recorded.
    assert all(peak <= BUDGET_MB * 0.99 for _, peak in runner.ran)
    assert not any(r.oom for r in plan.records)
    for r in plan.records:
        assert r.planned_mb == pytest.approx(planned(cfg, r.point.as_config("")))
        assert r.point in plan.planned

    # The trials: the baseline, one per layout (max_trials - 3 of them at most), then refinements.
    assert len(plan.records) == len(points) == max_trials
    assert plan.records[0].purpose == "baseline" and plan.records[0].point == baseline
    assert plan.baseline is plan.records[0]
    n_layout = min(len(plan.layouts), max_trials - 3)
    purposes = [r.purpose for r in plan.records]
    assert purposes == ["baseline"] + ["layout"] * n_layout + ["refine"] * (max_trials - 1 - n_layout)
    layout_trials = [r.point for r in plan.records if r.purpose == "layout"]
    assert len({p.layout[:3] for p in layout_trials}) == n_layout  # one trial per layout
    assert len({r.point for r in plan.records}) == len(plan.records)  # no point twice
    for p in layout_trials:
        # The representative: 1F1B, unsharded and without checkpointing when that fits, the largest
        # micro-batch leaving 2 pp micro-batches.
        assert p.layout[3] == "1f1b"
        plain = [
            q
            for q in plan.fitting
            if q.layout[:3] == p.layout[:3]
            and q.layout[3] == "1f1b"
            and not q.layout[5]
            and not q.activation_checkpointing
        ]
        if plain:
            assert p in plain
            filled = [q for q in plain if p.layout[1] == 1 or q.num_microbatches >= 2 * p.layout[1]]
            assert p.micro_batch_size == max(q.micro_batch_size for q in filled or plain)
    assert favoured in {p.layout[:3] for p in layout_trials}

    # Refinements stay in the fastest point's layout; the winner is the fastest trial that fitted.
    assert all(r.point.layout[:3] == favoured for r in plan.records if r.purpose == "refine")
    best = plan.best
    assert best is max(plan.records, key=lambda r: r.speed(plan.metric))
    assert best.point.layout[:3] == favoured and best.fits(BUDGET_MB)
    assert best.tokens_per_s > plan.baseline.tokens_per_s
    assert plan.next() is None  # done: max_trials reached


def test_refinement_moves_to_a_faster_variant_until_it_finds_the_fastest_fitting_point(cfg):
    favoured = (4, 2, 1)
    # Interleaved 1F1B much faster: the layout's representative (1F1B, one sample per micro-batch)
    # is not the answer; getting there takes two moves (a larger micro-batch, then the schedule).
    speed = layout_speed(favoured, {"interleaved_1f1b": 1.5})
    plan = LayoutPlan(cfg, 8, 8, GLOBAL_BATCH, BUDGET_MB, max_trials=30, baseline=baseline_point(cfg))
    drive(plan, Runner(cfg, BUDGET_MB, speed))
    truth = max(plan.fitting, key=lambda p: speed(p.as_config("")))
    assert truth.layout[:4] == (*favoured, "interleaved_1f1b")
    rep = next(r.point for r in plan.records if r.purpose == "layout" and r.point.layout[:3] == favoured)
    assert rep.layout[3] == "1f1b" and rep != truth
    assert plan.best.point == truth
    assert len(plan.records) < 30  # it stopped when no change was faster, not at max_trials
    # Greedy: every refinement is one change (schedule, sharding or checkpointing, or else the
    # micro-batch alone) from the fastest point before it, and it moved more than once.
    best, moves = None, 0
    for r in plan.records:
        if r.purpose == "refine":
            changed = [
                best.layout[3] != r.point.layout[3],
                best.layout[5] != r.point.layout[5],
                best.activation_checkpointing != r.point.activation_checkpointing,
            ]
            assert r.point.layout[:3] == best.layout[:3]
            assert sum(changed) == 1 or (sum(changed) == 0 and r.point.micro_batch_size != best.micro_batch_size)
        if best is None or r.speed(plan.metric) > speed(best.as_config("")):
            moves += r.purpose == "refine"
            best = r.point
    assert best == truth and moves >= 2


def test_metric_picks_the_clock(cfg):
    """`tokens_per_cpu_s` ranks by CPU time: a layout fast on the wall clock but slow on CPU
    does not win."""
    wall = layout_speed((2, 4, 1))
    cpu = layout_speed((4, 2, 1))
    plan = LayoutPlan(cfg, 8, 8, GLOBAL_BATCH, BUDGET_MB, max_trials=10, metric="tokens_per_cpu_s")
    drive(plan, Runner(cfg, BUDGET_MB, wall, cpu_speed=cpu))
    assert plan.best.point.layout[:3] == (4, 2, 1)
    assert all(r.point.layout[:3] == (4, 2, 1) for r in plan.records if r.purpose == "refine")


def test_layout_plan_one_trial_at_a_time(cfg):
    plan = LayoutPlan(cfg, 8, 8, GLOBAL_BATCH, BUDGET_MB, max_trials=4)
    point = plan.next()
    with pytest.raises(RuntimeError, match="observe"):
        plan.next()
    other = dict(point, micro_batch_size=point["micro_batch_size"] * 2)
    with pytest.raises(ValueError, match="expected a result"):
        plan.observe(other, {})
    with pytest.raises(ValueError, match="expected a result"):
        plan.observe(dict(point, purpose="refine"), {})
    record = plan.observe(point, Runner(cfg, BUDGET_MB, lambda p: 1.0)(point))
    assert record.point == Point.of(point) and record.purpose == "layout"
    with pytest.raises(ValueError, match="expected a result"):
        plan.observe(point, {})  # nothing pending any more
    # A crashed trial fits nothing and is not the best.
    second = plan.next()
    crashed = plan.observe(second, None, error=True)
    assert crashed.error and not crashed.fits(BUDGET_MB) and plan.best is record


def test_a_baseline_over_the_budget_is_not_run(cfg):
    baseline = baseline_point(cfg)
    tight = 3.0  # the baseline is planned at about 3.9 MB
    assert planned(cfg, baseline.as_config("")) > tight
    plan = LayoutPlan(cfg, 8, 8, GLOBAL_BATCH, tight, max_trials=10, baseline=baseline)
    runner = Runner(cfg, tight, layout_speed((4, 2, 1)))
    drive(plan, runner)
    assert plan.baseline is None and baseline not in {r.point for r in plan.records}
    assert all(peak <= tight * 0.99 for _, peak in runner.ran)
    assert plan.records[0].purpose == "layout"


def test_every_layout_with_a_fitting_point_gets_a_trial(cfg):
    """Global batch 4: dp4 x pp2 and dp2 x pp4 leave fewer micro-batches per replica than stages,
    which 1F1B cannot run but GPipe and the interleaved schedules can; such a layout is listed in
    `layouts` and has fitting points, so it gets its layout trial (on another schedule)."""
    plan = LayoutPlan(cfg, 8, 8, 4, 1e6, max_trials=20)
    assert (4, 2, 1) in plan.layouts and (2, 4, 1) in plan.layouts
    assert not any(p.layout[3] == "1f1b" for p in plan.fitting if p.layout[:3] == (4, 2, 1))
    points = drive(plan, Runner(cfg, 1e6, layout_speed((4, 2, 1))))
    tried = {(p["dp"], p["pp"], p["tp"]) for p in points if p["purpose"] == "layout"}
    assert tried == set(plan.layouts)


# -- TunePlan with a fixed global batch ----------------------------------------------------------


class LinearMemory:
    """Peak MB per key: fixed + per_sample * m (less per sample with checkpointing), independent
    of the number of micro-batches (1F1B past the pipeline fill)."""

    KEYS: ClassVar[dict[str, tuple[float, float]]] = {
        "rank0/stage0/forward": (300.0, 9.0),
        "rank0/stage0/backward": (320.0, 12.0),
        "rank1/stage1/step": (400.0, 0.0),
    }

    def __init__(self, budget_mb: float):
        self.budget_mb = budget_mb
        self.runs: list[int] = []

    def peaks(self, m: int, ac: bool) -> dict[str, float]:
        scale = 0.25 if ac else 1.0
        return {k: fixed + scale * per * m for k, (fixed, per) in self.KEYS.items()}

    def peak(self, m: int, ac: bool) -> float:
        return max(self.peaks(m, ac).values())

    def largest(self, candidates: list[int], ac: bool) -> int:
        return max((m for m in candidates if self.peak(m, ac) <= self.budget_mb), default=0)


def step_time(m: int, n: int, bubble, c0: float = 5.0, c1: float = 1.0) -> float:
    return n / (1 - bubble(n)) * (c0 + c1 * m)


def run_fixed(plan: TunePlan, memory: LinearMemory, per_replica: int, bubble, **costs):
    points = []
    while (point := plan.next()) is not None:
        points.append(point)
        m, n, ac = point["micro_batch_size"], point["num_microbatches"], point["activation_checkpointing"]
        peaks = memory.peaks(m, ac)
        oom = max(peaks.values()) > memory.budget_mb
        t = step_time(m, n, bubble, **costs) * (1.3 if ac else 1.0)
        plan.observe(
            point,
            {
                "oom": int(oom),
                "tokens_per_s": 0.0 if oom else per_replica / t,
                "step_time_s": t,
                **{PEAK_PREFIX + k: v for k, v in peaks.items()},
            },
        )
    return points


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("budget_mb", [600.0, 900.0, 1400.0])
def test_fixed_global_batch_finds_the_largest_candidate_and_the_fastest_size(budget_mb):
    pp, per_replica = 4, 256
    candidates = divisors(per_replica)
    # 1F1B needs pp micro-batches: the sizes that leave at least that many.
    sizes = [m for m in candidates if per_replica // m >= pp]

    def bubble(n):
        return (pp - 1) / (n + pp - 1)

    memory = LinearMemory(budget_mb)
    largest = {ac: memory.largest(sizes, ac) for ac in (False, True)}
    assert all(largest.values())
    plan = TunePlan(
        budget_mb,
        per_replica=per_replica,
        candidates={False: sizes, True: sizes},
        bubble=bubble,
        probes={ac: (max(1, largest[ac] // 2), largest[ac]) for ac in (False, True)},
    )
    points = run_fixed(plan, memory, per_replica, bubble)

    for p in points:
        assert p["num_microbatches"] * p["micro_batch_size"] == per_replica  # the global batch is kept
        assert p["micro_batch_size"] in sizes
    for ac in (False, True):
        assert plan.largest_micro_batch(ac) == largest[ac]
        assert plan.memory_trials(ac) <= 4

    # The fastest candidate that fits, by the step-time model.
    def true_time(m, ac):
        return step_time(m, per_replica // m, bubble) * (1.3 if ac else 1.0)

    fitting = [(m, ac) for ac in (False, True) for m in sizes if memory.peak(m, ac) <= budget_mb]
    fastest = min(fitting, key=lambda x: true_time(*x))
    assert (plan.best.point.micro_batch_size, plan.best.point.activation_checkpointing) == fastest

    # Throughput trials only on sizes that fit and that the fitted line (exact here: the model is
    # the line's) puts within SLACK of the fastest size that setting's memory search ran.
    for ac in (False, True):
        memory_run = [
            r.point.micro_batch_size
            for r in plan.records
            if r.purpose == "memory" and r.point.activation_checkpointing == ac
        ]
        fastest_run = min(true_time(m, ac) for m in memory_run if memory.peak(m, ac) <= budget_mb)
        timed = [
            r.point.micro_batch_size
            for r in plan.records
            if r.purpose == "throughput" and r.point.activation_checkpointing == ac
        ]
        assert len(timed) <= plan.extra
        for m in timed:
            assert m <= largest[ac] and m not in memory_run
            assert true_time(m, ac) <= (1 + SLACK) * fastest_run
        # ... and every size that beats the fastest run by the model is timed (up to `extra`).
        better = sorted(
            (m for m in sizes if m <= largest[ac] and m not in memory_run and true_time(m, ac) < fastest_run),
            key=lambda m: true_time(m, ac),
        )
        assert better[: plan.extra] == timed[: len(better[: plan.extra])]


def test_one_timed_size_without_a_pipeline_needs_no_throughput_trial():
    per_replica = 64
    sizes = divisors(per_replica)
    memory = LinearMemory(450.0)  # backward: 320 + 12 m -> 8 fits (416), 16 does not (512)
    assert memory.largest(sizes, False) == 8

    def no_bubble(n):
        return 0.0

    plan = TunePlan(
        memory.budget_mb,
        per_replica=per_replica,
        candidates={False: sizes},
        activation_checkpointing=(False,),
        bubble=no_bubble,
        probes=(8, 16),
    )
    points = run_fixed(plan, memory, per_replica, no_bubble)
    assert [(p["micro_batch_size"], p["purpose"]) for p in points] == [(8, "memory"), (16, "memory")]
    assert plan.best.point == Point(8, 8, False)

    # The same in a pipeline: a smaller size has a smaller bubble, so the next smaller ones are timed.
    def bubble(n):
        return 3 / (n + 3)

    plan = TunePlan(
        memory.budget_mb,
        per_replica=per_replica,
        candidates={False: sizes},
        activation_checkpointing=(False,),
        bubble=bubble,
        probes=(8, 16),
    )
    points = run_fixed(plan, memory, per_replica, bubble)
    assert [(p["micro_batch_size"], p["purpose"]) for p in points] == [
        (8, "memory"),
        (16, "memory"),
        (4, "throughput"),
        (2, "throughput"),
    ]


def test_planner_over_budget_throughput_point_is_skipped_not_run():
    """Free global batch: the planner puts (M, 2 n0) over the budget (a receive buffer per extra
    micro-batch); it is skipped, (M/2, 2 n0) runs."""
    memory = LinearMemory(1000.0)
    n0 = 2
    largest = memory.largest(list(range(1, 200)), False)

    def planner(point: Point) -> float:
        return memory.peak(point.micro_batch_size, point.activation_checkpointing) + 6.0 * point.micro_batch_size * (
            point.num_microbatches - n0
        )

    assert planner(Point(largest, 2 * n0, False)) > memory.budget_mb
    assert planner(Point(largest // 2, 2 * n0, False)) <= memory.budget_mb
    plan = TunePlan(memory.budget_mb, n0=n0, activation_checkpointing=(False,), planner=planner)
    ran = []
    while (point := plan.next()) is not None:
        ran.append(Point.of(point))
        m = point["micro_batch_size"]
        peaks = memory.peaks(m, False)
        plan.observe(point, {"oom": 0, "tokens_per_s": float(m), **{PEAK_PREFIX + k: v for k, v in peaks.items()}})
    assert plan.largest_micro_batch(False) == largest
    skipped = Point(largest, 2 * n0, False)
    assert [p for p, _ in plan.skipped] == [skipped]
    assert plan.skipped[0][1] == pytest.approx(planner(skipped))
    assert skipped not in ran
    assert Point(largest // 2, 2 * n0, False) in ran
    assert all(r.planned_mb == pytest.approx(planner(r.point)) for r in plan.records)


# -- space --------------------------------------------------------------------------------------


def test_batch_sizes_leave_a_valid_schedule(cfg_pp2):
    # 1F1B on 2 stages needs 2 micro-batches: 8 is out; GPipe takes any number.
    assert space.batch_sizes(cfg_pp2, 8, {"activation_checkpointing": False}) == [1, 2, 4]
    assert space.batch_sizes(cfg_pp2, 8, {"activation_checkpointing": True}) == [1, 2, 4]
    assert space.batch_sizes(cfg_pp2, 8, {"schedule": "gpipe", "activation_checkpointing": False}) == [1, 2, 4, 8]
    assert space.batch_sizes(cfg_pp2, 12) == [1, 2, 3, 4, 6]  # divisors leaving 2 micro-batches
    for m in space.batch_sizes(cfg_pp2, 8):
        t = space.trial_config(
            cfg_pp2, {"micro_batch_size": m, "num_microbatches": 8 // m, "activation_checkpointing": False}
        )
        assert t.train.global_batch_size == 8 and t.train.micro_batch_size == m
        assert space.is_valid(t)


def test_largest_planned_agrees_with_a_scan(cfg_pp2):
    sizes = list(range(1, 65))

    def point_of(m):
        return {"micro_batch_size": m, "num_microbatches": 2, "activation_checkpointing": False}

    peaks = {m: planned(cfg_pp2, point_of(m)) for m in sizes}
    assert all(peaks[a] < peaks[b] for a, b in itertools.pairwise(sizes))  # growing, so bisection holds
    for limit in (peaks[1] - 0.01, peaks[1], (peaks[7] + peaks[8]) / 2, peaks[40], peaks[64] + 1):
        scan = max((m for m in sizes if peaks[m] <= limit), default=0)
        assert space.largest_planned(cfg_pp2, point_of, limit, sizes=sizes) == scan
    # Among a fixed batch's sizes only.
    divs = [1, 2, 4, 8, 16, 32, 64]
    limit = (peaks[20] + peaks[21]) / 2
    assert space.largest_planned(cfg_pp2, point_of, limit, sizes=divs) == 16
    assert space.largest_planned(cfg_pp2, point_of, limit, cap=64) == 20


def test_planned_probes():
    assert space.planned_probes(20, (1, 2)) == (10, 20)
    assert space.planned_probes(3, (1, 2)) == (1, 3)
    assert space.planned_probes(2, (1, 2)) == (1, 2)
    assert space.planned_probes(1, (3, 7)) == (3, 7)
    assert space.planned_probes(0, (1, 2)) == (1, 2)


# -- the report ---------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["tokens_per_cpu_s", "tokens_per_s"])
def test_the_report_lists_each_column_once(cfg, tmp_path, capsys, metric):
    """tune_results.csv's header and the printed table's name every column once (a layout search
    prints the topology columns too, and on CPU the CPU-time column)."""
    import csv

    from rayhybrid.tune import report

    plan = LayoutPlan(cfg, 8, 8, GLOBAL_BATCH, BUDGET_MB, max_trials=5, metric=metric, baseline=baseline_point(cfg))
    drive(plan, Runner(cfg, BUDGET_MB, layout_speed((2, 2, 2))))
    assert len({r.point.layout[:3] for r in plan.records}) > 1  # trials on several layouts
    capsys.readouterr()
    report.write(cfg, plan, tmp_path, 1.0, ["+topology=dp2_pp2_tp2"])
    printed = capsys.readouterr().out.strip().split("\n\ntrain with:")[0].splitlines()

    with open(tmp_path / "tune_results.csv", newline="") as f:
        header = next(csv.reader(f))
    assert len(header) == len(set(header)), header
    assert header == list(report.COLUMNS)
    table_header = printed[0].split()
    assert len(table_header) == len(set(table_header)), table_header
    assert {"dp", "pp", "tp", "schedule", "shard", "tokens/s"} <= set(table_header)
    assert ("tokens/CPU-s" in table_header) == (metric == "tokens_per_cpu_s")
    assert len(printed) == 1 + len(plan.records)
    assert {len(line) for line in printed} == {len(printed[0])}  # right-aligned cells, one per column


def test_offload_is_a_candidate_where_nothing_else_fits_on_cuda():
    """On CUDA the planner takes the blocks' saved activations off the device with
    train.offload_activations: a point over the budget without it becomes a candidate with it;
    a point that fits without it gets no offload twin; on a CPU device (the host is the device)
    offload frees nothing and is never a candidate."""
    cfg = to_config(compose(["train.global_batch_size=16", "train.micro_batch_size=16"]))
    one = Point(16, 1, False, (1, 1, 1, "1f1b", 1, False))
    without = space.planned_peak_mb(space.trial_config(cfg, one.as_config("")), cuda=True)
    moved = Point(16, 1, False, one.layout, True)
    with_it = space.planned_peak_mb(space.trial_config(cfg, moved.as_config("")), cuda=True)
    assert with_it < without
    budget = (with_it + without) / 2 / 0.99
    plan = LayoutPlan(cfg, 1, 1, 16, budget, activation_checkpointing=(False,), cuda=True)
    offloaded = {p for p in plan.planned if p.offload_activations}
    assert moved in offloaded and moved in plan.fitting and one not in plan.fitting
    for p in offloaded:  # only where the point without it is over the budget
        assert plan.planned[dataclasses.replace(p, offload_activations=False)] > plan.limit_mb
    # The layout's representative fits without offload (micro-batch 8); refining tries offload
    # at the largest micro-batch it fits, which wins here (larger micro-batches run faster).
    ran = []
    while (point := plan.next()) is not None:
        ran.append(Point.of(point))
        plan.observe(point, {"oom": 0, "tokens_per_s": 100.0 + point["micro_batch_size"], PEAK_PREFIX + "r": 1.0})
    assert ran[0] == Point(8, 2, False, one.layout) and moved in ran and plan.best.point == moved
    assert space.trial_config(cfg, moved.as_config("")).train.offload_activations
    assert "train.offload_activations=true" in report.training_overrides(
        cfg, trials.Record(moved, "layout", False, {"x": with_it}, 1.0)
    )
    cpu = LayoutPlan(cfg, 1, 1, 16, budget, activation_checkpointing=(False,))
    assert not any(p.offload_activations for p in cpu.planned)


def test_offload_over_a_nodes_host_memory_fits_no_budget():
    """train.offload_activations' host share (per rank x ranks per node) must fit the node's
    host memory: a point over it is no candidate of the layout search, nor a size of the
    micro-batch search's, however much device memory it frees."""
    cfg = to_config(compose(["train.global_batch_size=16", "train.micro_batch_size=16"]))
    moved = Point(16, 1, False, (1, 1, 1, "1f1b", 1, False), True)
    moved_cfg = space.trial_config(cfg, moved.as_config(""))
    host = host_memory_mb(moved_cfg, cuda=True)
    with_it = space.planned_peak_mb(moved_cfg, cuda=True)
    assert host > 0 and space.planned_peak_mb(moved_cfg, cuda=True, host=(host, 1)) == with_it
    assert space.planned_peak_mb(moved_cfg, cuda=True, host=(host * 1.5, 2)) == math.inf  # two ranks a node
    without = space.planned_peak_mb(
        space.trial_config(cfg, dataclasses.replace(moved, offload_activations=False).as_config("")), cuda=True
    )
    budget = (with_it + without) / 2 / 0.99
    roomy = LayoutPlan(cfg, 1, 1, 16, budget, activation_checkpointing=(False,), cuda=True, host_mb=host)
    tight = LayoutPlan(cfg, 1, 1, 16, budget, activation_checkpointing=(False,), cuda=True, host_mb=host * 0.99)
    assert moved in roomy.fitting and moved not in tight.fitting
    on = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, offload_activations=True))
    point_of = lambda m: {"micro_batch_size": m, "num_microbatches": 16 // m, "activation_checkpointing": False}
    assert space.largest_planned(on, point_of, budget, sizes=[1, 2, 4, 8, 16], cuda=True) == 16
    assert space.largest_planned(on, point_of, budget, sizes=[1, 2, 4, 8, 16], cuda=True, host=(host * 0.99, 1)) == 8


def test_a_trial_that_runs_the_host_out_of_memory_is_a_miss():
    for message in (
        "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "RuntimeError: [enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory",
        "OSError: [Errno 12] Cannot allocate memory",
        "ray.exceptions.ActorDiedError: Task was killed due to the node running low on memory.",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ):
        assert trials.out_of_memory(message), message
    assert not trials.out_of_memory("RuntimeError: shape mismatch")
    assert not trials.out_of_memory("ValueError: the memory budget is not a number")


def test_the_layout_search_takes_a_nodes_host_memory_from_ray(monkeypatch):
    """search_plan reads a node's host memory from Ray (the least `memory` resource of a node
    with the trials' device): a node too small for the offload twin's host share drops it."""
    from rayhybrid.cluster import connect
    from rayhybrid.cluster.placement import ReplicaShape
    from rayhybrid.tune import run

    cfg = to_config(compose(["train.global_batch_size=16", "train.micro_batch_size=16", "tune.search=layout"]))
    moved = Point(16, 1, False, (1, 1, 1, "1f1b", 1, False), True)
    with_it = space.planned_peak_mb(space.trial_config(cfg, moved.as_config("")), cuda=True)
    without = space.planned_peak_mb(
        space.trial_config(cfg, dataclasses.replace(moved, offload_activations=False).as_config("")), cuda=True
    )
    budget = (with_it + without) / 2 / 0.99
    host = host_memory_mb(space.trial_config(cfg, moved.as_config("")), cuda=True) * 2**20
    shape = ReplicaShape(1, 1, True, 1.0)
    for memory, kept in ((host, True), (host * 0.99, False)):
        nodes = [{"Resources": {"GPU": 1.0, "memory": memory}}, {"Resources": {"CPU": 4.0, "memory": 1.0}}]
        monkeypatch.setattr(connect, "alive_nodes", lambda nodes=nodes: nodes)
        plan = run.search_plan(cfg, shape, budget)
        assert (moved in plan.fitting) is kept, memory
