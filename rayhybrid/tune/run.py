"""`python -m rayhybrid.tune`: a Ray Tune search whose trials are short runs of the real trainer.

The workers are started once and kept while the topology stays: each trial joins them again
under its own micro-batch size, number of micro-batches and activation-checkpointing setting
(`WorkerGroup.reconfigure`), trains `tune.steps` steps with `metrics.memory` on, and reports the
peaks of every rank, stage and phase after the first step (once optimizer state exists) and the
throughput of the steps after the first. A layout search's trial on another dp x pp x tp starts
a new group. They live in a `TrialHost` actor, which every Tune trial calls; Tune's own trial
processes stay light (no resources, no torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import ray

from rayhybrid.config.compose import replace
from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout
from rayhybrid.errors import ConfigError, RayHybridError, WorkerError
from rayhybrid.preflight import check_config, check_environment
from rayhybrid.tune import space
from rayhybrid.tune.microbatch import TunePlan
from rayhybrid.tune.ray_searcher import PlanSearcher
from rayhybrid.tune.space import TOPOLOGY_FIELDS, trial_config
from rayhybrid.tune.trials import PEAK_PREFIX, Point, limiting_peaks, out_of_memory, peaks_of

log = logging.getLogger("rayhybrid")

SEARCHES = ("micro_batch", "layout")
POINT_KEYS = (
    "micro_batch_size",
    "num_microbatches",
    "activation_checkpointing",
    "offload_activations",
    *TOPOLOGY_FIELDS,
    "purpose",
)


class TrialHost:
    """Owns the worker group across trials; `run` is one trial (a Ray actor, see `start`)."""

    def __init__(self, cfg: Config, shape) -> None:
        self.cfg = cfg
        self.shape = shape
        self.group = None

    def run(self, point: dict) -> dict:
        from rayhybrid.cluster.group import WorkerGroup

        cfg = trial_config(self.cfg, point)
        try:
            check_config(cfg)  # the environment was checked once, by tune_main
        except ConfigError as err:
            return {"oom": 0, "error": str(err), "tokens_per_s": 0.0}
        start = time.perf_counter()
        t = cfg.topology
        shape = dataclasses.replace(self.shape, pp=t.pp, tp=t.tp)
        if self.group is not None and (self.group.shape != shape or self.group.cfg.topology.dp != t.dp):
            self.shutdown()  # another layout: other placement groups and ranks
        try:
            if self.group is None:
                self.group = WorkerGroup(cfg, shape)
                self.group.start()
            else:
                self.group.reconfigure(cfg)
            steps = [self.group.train(1, timeout_s=cfg.tune.step_timeout_s)[0].metrics for _ in range(cfg.tune.steps)]
        except WorkerError as err:
            errors = self.group.errors() if self.group is not None else {}
            oom = [rank for rank, msg in errors.items() if out_of_memory(msg)] or (
                [err.rank] if out_of_memory(err.message) else []
            )
            if oom:
                first = errors.get(oom[0], err.message)
                return {
                    "oom": 1,
                    "error": "",
                    "tokens_per_s": 0.0,
                    "oom_ranks": oom,
                    "message": first,
                    "trial_s": time.perf_counter() - start,
                }
            return {"oom": 0, "error": str(err), "tokens_per_s": 0.0, "trial_s": time.perf_counter() - start}
        measured = steps[1:] or steps  # memory once optimizer state exists; speed after warm-up
        peaks, allocated = limiting_peaks(measured), peaks_of(measured, "peak_mb")
        seconds = sum(m["step_time_s"] for m in measured)
        tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in measured)
        cpu = sum(m.get("cpu_s", 0.0) for m in measured)
        return {
            "oom": 0,
            "error": "",
            "peak_mb": max(peaks.values(), default=0.0),
            "allocated_peak_mb": max(allocated.values(), default=0.0),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "tokens_per_cpu_s": tokens / cpu if cpu else 0.0,
            "step_time_s": seconds / len(measured),
            "cpu_s": cpu / len(measured),
            "loss": steps[-1]["loss"],
            "trial_s": time.perf_counter() - start,
            **{PEAK_PREFIX + key: mb for key, mb in peaks.items()},
        }

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


MAX_TRIALS = 200  # a bound for Tune; the plan finishes long before (about 10 trials)


def _trial(config: dict, host=None) -> None:
    """A Tune trial: one call to the host."""
    from ray import tune

    point = {k: config[k] for k in POINT_KEYS if k in config}
    tune.report(ray.get(host.run.remote(point)))


def device_capacity_mb(shape) -> float:
    """Memory of one GPU of the cluster (asked of a GPU task: the driver may have none)."""

    @ray.remote(num_gpus=1, num_cpus=0)
    def capacity() -> float:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 2**20

    return ray.get(capacity.remote())


def first_microbatches(cfg: Config) -> int:
    return cfg.tune.num_microbatches or cfg.topology.pp


def fixed_global_batch(cfg: Config) -> int:
    """The global batch every trial trains (0: free); a layout search always fixes one."""
    if cfg.tune.search == "layout":
        return cfg.tune.global_batch_size or cfg.train.global_batch_size
    return cfg.tune.global_batch_size


def base_point(cfg: Config, ac: bool, m: int, layout: bool = False) -> dict:
    """A trial point on the base topology: `m` per micro-batch, the micro-batches a fixed global
    batch needs (or the memory search's first number)."""
    g = fixed_global_batch(cfg)
    n = g // (cfg.topology.dp * m) if g else first_microbatches(cfg)
    point = {"micro_batch_size": m, "num_microbatches": n, "activation_checkpointing": ac}
    if layout:
        point.update(space.topology_fields(cfg))
    return point


def layout_devices(cfg: Config) -> int:
    """The devices a layout search lays out: tune.devices, or the topology given's."""
    t = cfg.topology
    return cfg.tune.devices or t.dp * t.pp * t.tp


def micro_batch_plan(cfg: Config, budget: float, cuda: bool, metric: str, host: tuple | None = None) -> TunePlan:
    """The micro-batch search on the base topology: the sizes a fixed global batch allows, and
    probes the planner places (unless tune.probes gives them). `host`: a node's host memory (MB)
    and its ranks, which train.offload_activations' host share must fit."""
    from rayhybrid.plan import estimate as est

    t, tc = cfg.topology, cfg.tune
    g = fixed_global_batch(cfg)
    per_replica = g // t.dp if g else 0
    settings = tuple(dict.fromkeys(bool(ac) for ac in tc.activation_checkpointing))
    candidates = (
        {ac: space.batch_sizes(cfg, per_replica, {"activation_checkpointing": ac}) for ac in settings}
        if per_replica
        else None
    )
    probes = {}
    for ac in settings:
        if tc.probes:
            probes[ac] = tuple(tc.probes)
            continue
        largest = space.largest_planned(
            cfg,
            lambda m, ac=ac: base_point(cfg, ac, m),
            budget * (1 - tc.margin),
            sizes=candidates[ac] if candidates else None,
            cap=tc.max_micro_batch,
            cuda=cuda,
            host=host,
        )
        probes[ac] = space.planned_probes(largest, (1, 2))
    v = Layout.of(cfg).virtual_stages
    return TunePlan(
        budget,
        n0=first_microbatches(cfg),
        activation_checkpointing=settings,
        probes=probes,
        margin=tc.margin,
        max_micro_batch=tc.max_micro_batch,
        per_replica=per_replica,
        candidates=candidates,
        bubble=lambda n: est.bubble_fraction(t.schedule, t.pp, n, v)[0],
        planner=lambda point: space.planned_peak_mb(trial_config(cfg, point.as_config("")), cuda=cuda, host=host),
        metric=metric,
    )


def layout_plan(cfg: Config, budget: float, cuda: bool, metric: str, gpus_per_node: int, host_mb: float = 0.0):
    from rayhybrid.tune.layout import LayoutPlan

    t, tc = cfg.topology, cfg.tune
    devices = layout_devices(cfg)
    per_node = tc.devices_per_node or (gpus_per_node if cuda else devices)
    g = fixed_global_batch(cfg)
    baseline = None
    if t.dp * t.pp * t.tp == devices and g % (t.dp * cfg.train.micro_batch_size) == 0:
        baseline = Point.of(base_point(cfg, bool(cfg.train.activation_checkpointing), cfg.train.micro_batch_size, True))
    return LayoutPlan(
        cfg,
        devices,
        per_node,
        g,
        budget,
        margin=tc.margin,
        activation_checkpointing=tuple(bool(ac) for ac in tc.activation_checkpointing),
        max_trials=tc.max_trials,
        metric=metric,
        cuda=cuda,
        baseline=baseline,
        host_mb=host_mb,
    )


def run_tune(cfg: Config, overrides: list[str] | tuple = ()) -> dict:
    """Connect, search, write the outputs; returns the summary (also in tune_summary.json)."""
    from rayhybrid.cluster import code
    from rayhybrid.cluster.connect import connect
    from rayhybrid.tune import report

    out = Path(cfg.run_dir or ".").resolve()
    out.mkdir(parents=True, exist_ok=True)
    with _tune_log(out) as ray_text:
        with ray_text.printed():  # Ray Tune's banners and tables, into tune.log
            started_ray = connect(cfg)
            host = None
            try:
                shape = _checked_shape(cfg)
                budget = resolve_budget_mb(cfg, shape)
                cfg = replace(cfg, tune={"memory_budget_mb": budget})
                plan = search_plan(cfg, shape, budget)
                # The host imports the model (its trials' checks) and starts the workers: it gets the
                # shipped code (cluster.code), and its workers inherit it.
                shipped = code.shipment(cfg)
                host_cls = ray.remote(num_cpus=0)(TrialHost).options(runtime_env=code.runtime_env(shipped))
                host = host_cls.remote(code.inherited(cfg, shipped), shape)
                wall = _run_trials(plan, host, out)
            finally:
                _release(host, started_ray)
        summary = report.write(cfg, plan, out, wall, list(overrides))
    if plan.best is None:
        raise RayHybridError(f"no trial fitted tune.memory_budget_mb={budget:g}; see {out / 'tune_results.csv'}")
    return summary


@contextlib.contextmanager
def _tune_log(out: Path):
    """The tune's log file, `<run dir>/tune.log`, for the run: rayhybrid's lines (also on the
    terminal: one per trial, the result table), and Ray's text instead of the terminal (the
    workers' stderr, C++ warnings included, the raylet's messages, the `ray` logger: the
    `RayText` it yields, whose `printed` adds Ray Tune's banners and tables). The terminal is as
    quiet as a training run's."""
    from rayhybrid.driver.raytext import RayText

    logger = logging.getLogger("rayhybrid")
    handler = logging.FileHandler(out / "tune.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    logger.addHandler(handler)
    text = RayText(out)  # finds tune.log: a handler of the `rayhybrid` logger in `out`
    try:
        yield text
    finally:
        text.close()  # after _release: a Ray this run started is gone
        logger.removeHandler(handler)
        handler.close()


def _checked_shape(cfg: Config):
    """The cluster's shape for this config, once it is known to hold the ranks a trial places."""
    from rayhybrid.cluster.connect import resolve_shape
    from rayhybrid.cluster.placement import check_capacity

    shape = resolve_shape(cfg)
    if cfg.tune.search == "layout":  # every layout places `devices` ranks
        check_capacity(dataclasses.replace(shape, pp=1, tp=1), layout_devices(cfg))
    else:
        check_capacity(shape, cfg.topology.dp)
    return shape


def resolve_budget_mb(cfg: Config, shape) -> float:
    """tune.memory_budget_mb, or on GPUs (when it is 0) one GPU's capacity."""
    budget = cfg.tune.memory_budget_mb
    if budget <= 0:
        if not shape.use_gpu:
            raise ConfigError(
                "tune.memory_budget_mb",
                "is required on CPU, where it plays the device capacity per rank; e.g. tune.memory_budget_mb=64",
            )
        budget = device_capacity_mb(shape)
    return budget


def search_plan(cfg: Config, shape, budget: float):
    """The `TunePlan` or `LayoutPlan` that tune.search asks for, logged (`cfg` carries the budget)."""
    from rayhybrid.cluster.connect import alive_nodes

    # On CPU the ranks share the cores: wall time measures the machine, not the layout. Rank
    # by the busiest rank's CPU time instead (it leaves out time spent waiting).
    metric = "tokens_per_s" if shape.use_gpu else "tokens_per_cpu_s"
    source = "GPU capacity" if shape.use_gpu and cfg.tune.memory_budget_mb <= 0 else "tune.memory_budget_mb"
    nodes = alive_nodes()
    # A node's host memory: the least Ray lends to tasks (its `memory` resource) on a node with
    # the trials' device; train.offload_activations' pinned copies live there.
    device = "GPU" if shape.use_gpu else "CPU"
    lent = [n["Resources"].get("memory", 0) for n in nodes if n.get("Resources", {}).get(device, 0)]
    host_mb = min(lent, default=0) / 2**20
    gpus = max((n.get("Resources", {}).get("GPU", 0) for n in nodes), default=0)
    if cfg.tune.search == "layout":
        plan = layout_plan(cfg, budget, shape.use_gpu, metric, int(gpus), host_mb)
        if not plan.planned:
            raise ConfigError(
                "tune.devices",
                f"no layout of {plan.devices} devices ({plan.devices_per_node} per node) is valid for this model "
                f"and global batch {fixed_global_batch(cfg)}; change tune.devices or tune.global_batch_size",
            )
        if not plan.fitting:
            raise RayHybridError(
                f"no layout of {plan.devices} devices is planned to fit "
                f"tune.memory_budget_mb={budget:g} ({plan.pruned} points over it); raise the budget or the devices"
            )
        log.info("tune: layout search, budget %.1f MB per rank (%s), ranked by %s", budget, source, metric)
        return plan
    t = cfg.topology
    world = t.dp * t.pp * t.tp
    ranks_per_node = min(world, int(gpus)) if shape.use_gpu and gpus else world
    plan = micro_batch_plan(cfg, budget, shape.use_gpu, metric, (host_mb, ranks_per_node))
    g = fixed_global_batch(cfg)
    log.info(
        "tune: dp %d x pp %d x tp %d, budget %.1f MB per rank (%s); %s; activation checkpointing %s; "
        "first probes %s; ranked by %s",
        t.dp,
        t.pp,
        t.tp,
        budget,
        source,
        f"global batch fixed at {g}" if g else f"memory search at {first_microbatches(cfg)} micro-batch(es)",
        "/".join("on" if ac else "off" for ac in plan.searches),
        ", ".join(f"{s.probes}" for s in plan.searches.values()),
        metric,
    )
    return plan


def _run_trials(plan, host, out: Path) -> float:
    """Ray Tune runs the plan's trials one at a time on `host`; the seconds it took."""
    from ray import tune

    searcher = PlanSearcher(plan)
    start = time.perf_counter()
    tuner = tune.Tuner(
        # Trials only call the host: no CPU of their own (Tune wants some resource: a few bytes).
        tune.with_resources(tune.with_parameters(_trial, host=host), {"cpu": 0, "memory": 1024}),
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=MAX_TRIALS, max_concurrent_trials=1),
        run_config=tune.RunConfig(storage_path=str(out), name="ray_tune", verbose=0),
    )
    tuner.fit()
    return time.perf_counter() - start


def _release(host, started_ray: bool) -> None:
    """Shut the trial host's workers down, and Ray if this run started it."""
    if host is not None:
        try:
            ray.get(host.shutdown.remote(), timeout=60)
        except (ray.exceptions.RayError, TimeoutError):
            pass
    if started_ray:
        ray.shutdown()


def tune_main(overrides: list[str], run_dir: str | Path | None = None) -> dict:
    """Compose, check and tune (the `python -m rayhybrid.tune` entry point, for scripts). The
    trials' configs pass the config's checks (`check_tune`, and each candidate as the search
    makes it); what they share in the world (data, stores, `cluster.code`) is checked here,
    once, on the first trial's config (trials log to no tracker)."""
    from rayhybrid.preflight import ensure_logging, load_run

    cfg = load_run(overrides, run_dir, check=False)
    check_tune(cfg)
    check_environment(trial_config(cfg, base_point(cfg, bool(cfg.tune.activation_checkpointing[0]), 1)))
    ensure_logging()
    return run_tune(cfg, overrides)


def check_tune(cfg: Config) -> None:
    """The tune section's one-line errors (exit 2), and the config's checks of the trials'
    configs (`check_config`), before Ray starts."""
    tc, t = cfg.tune, cfg.topology
    if tc.search not in SEARCHES:
        raise ConfigError("tune.search", f"must be one of {', '.join(SEARCHES)}; got {tc.search!r}")
    if not tc.activation_checkpointing:
        raise ConfigError("tune.activation_checkpointing", "needs at least one setting, e.g. [false,true]")
    probes = tuple(tc.probes)
    if probes and (len(probes) != 2 or not 0 < probes[0] < probes[1]):
        raise ConfigError(
            "tune.probes", f"must be two increasing positive sizes, e.g. [1,2], or [] (planned); got {list(probes)}"
        )
    if tc.steps < 2:
        raise ConfigError("tune.steps", "must be at least 2 (memory and speed are read after the first step)")
    for name in ("global_batch_size", "devices", "devices_per_node"):
        if getattr(tc, name) < 0:
            raise ConfigError(
                f"tune.{name}", f"must be >= 0 (0: see docs/planning-and-tuning.md); got {getattr(tc, name)}"
            )
    if tc.max_trials < 1:
        raise ConfigError("tune.max_trials", f"must be at least 1; got {tc.max_trials}")
    g = fixed_global_batch(cfg)
    if tc.search == "layout":
        from rayhybrid.plan import estimate as est

        if not est.has_memory_model(cfg):
            raise ConfigError(
                "tune.search",
                f"layout needs the planner's memory model, which model {cfg.model.module or cfg.model.name} lacks "
                "(ModelSpec.memory); search its micro-batch on a topology you choose instead",
            )
        devices = layout_devices(cfg)
        if tc.devices_per_node > devices:
            raise ConfigError("tune.devices_per_node", f"{tc.devices_per_node} is more than the {devices} devices")
        return
    if g and g % t.dp:
        raise ConfigError("tune.global_batch_size", f"{g} is not a multiple of topology.dp={t.dp}")
    # The trials' configs, not the base one, must be valid (the batch settings are the trials').
    for ac in dict.fromkeys(tc.activation_checkpointing):
        if g:
            if not space.batch_sizes(cfg, g // t.dp, {"activation_checkpointing": ac}):
                first = base_point(cfg, ac, 1)
                check_config(trial_config(cfg, first))  # the reason, as the config checks word it
                raise ConfigError("tune.global_batch_size", f"{g} leaves no valid micro-batch size on this topology")
            continue
        check_config(trial_config(cfg, base_point(cfg, ac, probes[0] if probes else 1)))
