"""`tune.search=layout`: the parallel layout for a device count, free of Ray.

For `devices` devices (`devices_per_node` per node) and a fixed global batch `G`, every point is
a way to train that batch:
- dp x pp x tp = devices, with tp dividing a node's devices (tensor parallelism stays on a node);
- the schedule (pp > 1: gpipe, 1f1b, and with two stages per rank interleaved_1f1b,
  interleaved_zb, zbv);
- dp_shard (dp > 1: replicated or FSDP2-sharded; and when dp spans nodes, HSDP over the
  replicas one node holds: `shard_options`);
- activation checkpointing (the settings `tune.activation_checkpointing` asks for);
- activation offload (train.offload_activations), on CUDA, for a point the planner says does
  not fit without it (and does with it), when the model's spec offloads;
- the micro-batch size, among the sizes that divide G / dp (and leave a valid schedule).

Every point the config checks reject is dropped; so is every point whose planned peak memory
(rayhybrid/plan/) is over the budget less the margin: no trial is spent on either. Trials then:
1. the base config as given (`baseline`, when it uses `devices` ranks and fits): the figure the
   winner is compared with;
2. one point per (dp, pp, tp) layout (`max_trials` less three of them at most), in the order
   of the fewest bytes communicated per step by the busiest rank (the planner's estimate): 1F1B (the trainer's default), unsharded and without checkpointing when that fits
   (then sharded, then with offload, then with checkpointing), and the largest micro-batch, in a pipeline the largest leaving at least 2 pp micro-batches per
   step (a bubble of at most about a third under 1F1B);
3. around the fastest point so far, one change at a time (the next larger and smaller
   micro-batch, the other schedules, dp_shard, checkpointing, offload), moving to any that is faster,
   until `max_trials` trials have run or no change is left.
The fastest point that fitted wins. Its memory was predicted before it ran: `planned_mb` beside
the measured peak, for every trial.

    plan = LayoutPlan(cfg, devices=8, devices_per_node=8, global_batch=16, budget_mb=64)
    while (point := plan.next()) is not None:
        plan.observe(point, run_trial(point))
"""

from __future__ import annotations

import dataclasses
import logging
import math

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import SCHEDULE_TABLE
from rayhybrid.models.registry import get_spec
from rayhybrid.tune.space import batch_sizes, is_valid, planned_peak_mb, trial_config
from rayhybrid.tune.trials import Point, Record, fastest, record_of

log = logging.getLogger("rayhybrid")

TRY_ORDER = ("1f1b", "gpipe", "zbv", "interleaved_1f1b", "interleaved_zb")
"""The schedules in the order the layout search tries them."""
STAGES_PER_RANK = {schedule: SCHEDULE_TABLE[schedule].default_stages_per_rank for schedule in TRY_ORDER}
"""The schedules a layout search tries, with the stages per rank it gives each (the order is the
order phase 3 tries them in after the representative's 1F1B)."""


def factorizations(devices: int, devices_per_node: int) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) with dp x pp x tp = devices and tp dividing a node's devices."""
    out = []
    for tp in range(1, devices + 1):
        if devices % tp or devices_per_node % tp:
            continue
        for pp in range(1, devices // tp + 1):
            if (devices // tp) % pp == 0:
                out.append((devices // (tp * pp), pp, tp))
    return out


def shard_options(dp: int, pp: int, tp: int, devices_per_node: int) -> tuple:
    """The topology.dp_shard values a search tries for a layout: replicated and FSDP2 over all
    of dp (dp > 1), and HSDP with a shard group of the replicas one node holds, when dp spans
    more than one node's (so shards are gathered inside a node and only gradients cross)."""
    if dp == 1:
        return (False,)
    group = math.gcd(dp, devices_per_node // (pp * tp))
    return (False, True, group) if 1 < group < dp else (False, True)


def _layout_point(dp, pp, tp, schedule, dp_shard, ac, m, per_replica, offload=False) -> Point:
    v = STAGES_PER_RANK[schedule] if pp > 1 else 1
    return Point(m, per_replica // m, ac, (dp, pp, tp, schedule if pp > 1 else "1f1b", v, dp_shard), offload)


def _offloads(cfg: Config) -> bool:
    """The model's spec offloads its blocks' activations (ModelSpec.offloads)."""
    return get_spec(cfg.model).offloads


class LayoutPlan:
    """The search above, driven like `TunePlan` (next / observe; `records`, `best`)."""

    def __init__(
        self,
        cfg: Config,
        devices: int,
        devices_per_node: int,
        global_batch: int,
        budget_mb: float,
        margin: float = 0.01,
        activation_checkpointing: tuple[bool, ...] = (False, True),
        max_trials: int = 10,
        metric: str = "tokens_per_s",
        cuda: bool = False,
        baseline: Point | None = None,
        host_mb: float = 0.0,
    ) -> None:
        self.cfg = cfg
        # A node's host memory and its ranks: train.offload_activations' host share must fit.
        self.host = (host_mb, min(devices, devices_per_node))
        self.budget_mb = budget_mb
        self.devices, self.devices_per_node = devices, devices_per_node
        self.metric = metric
        self.max_trials = max_trials
        self.cuda = cuda
        self.limit_mb = budget_mb * (1 - margin)
        self.offload = cuda and not cfg.train.offload_activations and _offloads(cfg)
        self.records: list[Record] = []
        self.planned: dict[Point, float] = {}  # every point that validates -> its planned peak MB
        self._pending: tuple[Point, str] | None = None
        self.layouts: list[tuple[int, int, int]] = []  # the (dp, pp, tp) with a point that validates
        self._enumerate(global_batch, [bool(ac) for ac in dict.fromkeys(activation_checkpointing)])
        self.fitting = [p for p, mb in self.planned.items() if mb <= self.limit_mb]
        self.pruned = len(self.planned) - len(self.fitting)
        self._queue = self._first_trials(baseline)
        log.info(
            "layout search: %d layouts, %d points that validate, %d pruned by planned memory over %.1f MB; "
            "at most %d trials",
            len(self.layouts),
            len(self.planned),
            self.pruned,
            self.limit_mb,
            max_trials,
        )

    def _enumerate(self, global_batch: int, settings: list[bool]) -> None:
        """Every point that validates, with its planned peak (`planned`), and the layouts they
        are on (`layouts`)."""
        for dp, pp, tp in factorizations(self.devices, self.devices_per_node):
            if global_batch % dp:
                continue
            found = False
            schedules = list(STAGES_PER_RANK) if pp > 1 else ["1f1b"]
            for schedule in schedules:
                for dp_shard in shard_options(dp, pp, tp, self.devices_per_node):
                    base = _layout_point(dp, pp, tp, schedule, dp_shard, False, 1, global_batch // dp).as_config("")
                    for m in batch_sizes(self.cfg, global_batch // dp, base):
                        for ac in settings:
                            point = _layout_point(dp, pp, tp, schedule, dp_shard, ac, m, global_batch // dp)
                            planned = self._plan(point)
                            if planned is None:
                                raise ValueError("a layout search needs the planner's memory model for the model")
                            self.planned[point] = planned
                            found = True
                            if planned > self.limit_mb and self.offload:
                                self._offload_candidate(point)
            if found:
                self.layouts.append((dp, pp, tp))

    def _offload_candidate(self, point: Point) -> None:
        """`point` with train.offload_activations, kept when the planner says it fits (on CUDA
        the blocks' saved activations leave the device's peak)."""
        moved = dataclasses.replace(point, offload_activations=True)
        planned = self._plan(moved)
        if planned is not None and planned <= self.limit_mb:
            self.planned[moved] = planned

    def _first_trials(self, baseline: Point | None) -> list[tuple[Point, str]]:
        """Phases 1 and 2: the baseline (when it validates and fits), then one representative
        per layout, the most promising first."""
        reps = sorted(
            (r for r in (self._representative(layout) for layout in self.layouts) if r is not None),
            key=self._promise,
        )
        queue: list[tuple[Point, str]] = []
        if baseline is not None and is_valid(trial_config(self.cfg, baseline.as_config(""))):
            planned = self.planned.get(baseline) or self._plan(baseline)
            if planned <= self.limit_mb:
                self.planned[baseline] = planned
                queue.append((baseline, "baseline"))
            else:
                log.info("the base config is planned at %.2f MB, over the budget: no baseline trial", planned)
        return queue + [(p, "layout") for p in reps[: max(1, self.max_trials - 3)]]

    # -- choosing ---------------------------------------------------------------------------

    def _plan(self, point: Point) -> float | None:
        """The planner's peak memory of `point` (MB, busiest rank)."""
        return planned_peak_mb(trial_config(self.cfg, point.as_config("")), cuda=self.cuda, host=self.host)

    def _representative(self, layout: tuple[int, int, int]) -> Point | None:
        """1F1B (or, where it cannot run or fit, the first schedule of STAGES_PER_RANK that
        can), unsharded, no checkpointing when such a point fits (then sharded, then with
        checkpointing); the largest micro-batch, in a pipeline the largest leaving at least 2 pp
        micro-batches."""
        pp = layout[1]
        mine = [p for p in self.fitting if p.layout[:3] == layout]
        orders = [(ac, shard, off) for ac in (False, True) for off in (False, True) for shard in (False, True)]
        for schedule in STAGES_PER_RANK:
            for ac, shard, off in orders:
                options = [
                    p
                    for p in mine
                    if p.layout[3] == schedule
                    and p.activation_checkpointing == ac
                    and p.layout[5] == shard
                    and p.offload_activations == off
                ]
                if options:
                    filled = [p for p in options if p.num_microbatches >= 2 * pp] if pp > 1 else options
                    return max(filled or options, key=lambda p: p.micro_batch_size)
        return None

    def _promise(self, point: Point) -> tuple[float, float]:
        """Order of the layouts' trials: the fewest bytes the busiest rank moves per step (the
        planner's communication estimate), then the smallest pipeline bubble; the compute is
        the same for every layout of a device count."""
        from rayhybrid.plan import estimate as est

        cfg = trial_config(self.cfg, point.as_config(""))
        t = cfg.topology
        wire = max(est.communication(cfg, r)["total_wire_bytes"] for r in range(t.pp))
        return wire, est.bubble_fraction(t.schedule, t.pp, point.num_microbatches, t.stages_per_rank)[0]

    def _variants(self, best: Point) -> list[Point]:
        """One change at a time from `best`: the neighbouring micro-batch sizes, the other
        schedules and dp_shard (each at the micro-batch nearest best's), checkpointing (at the
        largest micro-batch it fits)."""
        dp, pp, tp, schedule, _, shard = best.layout
        same = [p for p in self.fitting if p.layout[:3] == best.layout[:3]]

        def like(
            schedule=schedule, shard=shard, ac=best.activation_checkpointing, off=best.offload_activations
        ) -> list[Point]:
            return sorted(
                (
                    p
                    for p in same
                    if p.layout[3] == schedule
                    and p.layout[5] == shard
                    and p.activation_checkpointing == ac
                    and p.offload_activations == off
                ),
                key=lambda p: p.micro_batch_size,
            )

        out = []
        sizes = like()
        i = sizes.index(best) if best in sizes else -1
        if i >= 0:
            out += sizes[i + 1 : i + 2] + sizes[max(i - 1, 0) : i]

        def near(options: list[Point]) -> Point:
            return min(options, key=lambda p: abs(p.micro_batch_size - best.micro_batch_size))

        for other in (s for s in STAGES_PER_RANK if s != schedule and pp > 1):
            if options := like(schedule=other):
                out.append(near(options))
        for other in (s for s in shard_options(dp, pp, tp, self.devices_per_node) if s != shard):
            if options := like(shard=other):
                out.append(near(options))
        if options := like(ac=not best.activation_checkpointing):
            out.append(max(options, key=lambda p: p.micro_batch_size))
        if options := like(off=not best.offload_activations):
            out.append(max(options, key=lambda p: p.micro_batch_size))
        return out

    # -- the two calls a driver makes -------------------------------------------------------

    def next(self) -> dict | None:
        if self._pending is not None:
            raise RuntimeError("observe the running trial first")
        if len(self.records) >= self.max_trials:
            return None
        run = {r.point for r in self.records}
        while self._queue and self._queue[0][0] in run:
            self._queue.pop(0)
        if not self._queue:
            best = self.best
            if best is not None:
                self._queue = [(p, "refine") for p in self._variants(best.point) if p not in run]
        if not self._queue:
            return None
        self._pending = self._queue.pop(0)
        return self._pending[0].as_config(self._pending[1])

    def observe(self, config: dict, result: dict | None, error: bool = False) -> Record:
        point, purpose = self._pending or (None, None)
        if point is None or point.as_config(purpose) != config:
            raise ValueError(f"expected a result for {self._pending}, got {config}")
        self._pending = None
        record = record_of(point, purpose, result, error, planned_mb=self.planned.get(point))
        self.records.append(record)
        best = self.best
        if purpose == "refine" and best is not None and best.point == point:
            self._queue = []  # a faster point: its own changes come next
        return record

    # -- results ----------------------------------------------------------------------------

    @property
    def best(self) -> Record | None:
        return fastest(self.records, self.budget_mb, self.metric)

    @property
    def baseline(self) -> Record | None:
        return next((r for r in self.records if r.purpose == "baseline"), None)
