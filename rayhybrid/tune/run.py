"""`python -m rayhybrid.tune`: a Ray Tune search whose trials are short runs of the real trainer.

The workers are started once and kept for the whole search: each trial joins them again under
its own micro-batch size, number of micro-batches and activation-checkpointing setting
(`WorkerGroup.reconfigure`), trains `tune.steps` steps with `metrics.memory` on, and reports the
peaks of every rank, stage and phase after the first step (once optimizer state exists) and the
throughput of the steps after the first. They live in a `TrialHost` actor, which every Tune
trial calls; Tune's own trial processes stay light (no resources, no torch).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import ray

from rayhybrid.config.compose import replace
from rayhybrid.config.schema import Config
from rayhybrid.config.validate import validate
from rayhybrid.errors import ConfigError, RayHybridError, WorkerError
from rayhybrid.tune.plan import TunePlan
from rayhybrid.tune.search import PEAK_PREFIX
from rayhybrid.tune.searcher import PlanSearcher

log = logging.getLogger("rayhybrid")


def trial_config(cfg: Config, point: dict) -> Config:
    """The training config of one trial: the point's batch shape, memory metrics on, no evaluation
    (so no checkpoint.keep_best either: a trial saves no checkpoint), no experiment trackers (a
    trial logs to none; their checks would need wandb, mlflow and a W&B key where it runs)."""
    t = cfg.topology
    mb, n = point["micro_batch_size"], point["num_microbatches"]
    return replace(
        cfg,
        train={
            "micro_batch_size": mb,
            "global_batch_size": t.dp * mb * n,
            "activation_checkpointing": point["activation_checkpointing"],
            "steps": cfg.tune.steps,
            "log_every": cfg.tune.steps,
        },
        metrics={
            "memory": True,
            "wandb": dataclasses.replace(cfg.metrics.wandb, enabled=False),
            "mlflow": dataclasses.replace(cfg.metrics.mlflow, enabled=False),
        },
        eval={"every": 0},  # a trial measures training steps; held-out loss is not its concern
        checkpoint={"keep_best": False},  # it needs eval.every
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
            validate(cfg)
        except ConfigError as err:
            return {"oom": 0, "error": str(err), "tokens_per_s": 0.0}
        start = time.perf_counter()
        try:
            if self.group is None:
                self.group = WorkerGroup(cfg, self.shape)
                self.group.start()
            else:
                self.group.reconfigure(cfg)
            steps = [self.group.train(1, timeout_s=cfg.tune.step_timeout_s)[0] for _ in range(cfg.tune.steps)]
        except WorkerError as err:
            errors = self.group.errors() if self.group is not None else {}
            oom = [rank for rank, msg in errors.items() if "OutOfMemoryError" in msg] or (
                [err.rank] if "OutOfMemoryError" in err.message else []
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
        peaks: dict[str, float] = {}
        for metrics in measured:
            for key, mb in metrics["peak_mb"].items():
                peaks[key] = max(mb, peaks.get(key, 0.0))
        seconds = sum(m["step_time_s"] for m in measured)
        tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in measured)
        return {
            "oom": 0,
            "error": "",
            "peak_mb": max(peaks.values(), default=0.0),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "step_time_s": seconds / len(measured),
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

    point = {k: config[k] for k in ("micro_batch_size", "num_microbatches", "activation_checkpointing", "purpose")}
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


def run_tune(cfg: Config, overrides: list[str] | tuple = ()) -> dict:
    """Connect, search, write the outputs; returns the summary (also in tune_summary.json)."""
    from ray import tune

    from rayhybrid.cluster.connect import connect, resolve_shape
    from rayhybrid.cluster.placement import check_capacity
    from rayhybrid.tune import report

    out = Path(cfg.run_dir or ".").resolve()
    out.mkdir(parents=True, exist_ok=True)
    started_ray = connect(cfg)
    host = None
    try:
        shape = resolve_shape(cfg)
        check_capacity(shape, cfg.topology.dp)
        budget = cfg.tune.memory_budget_mb
        if budget <= 0:
            if not shape.use_gpu:
                raise ConfigError(
                    "tune.memory_budget_mb",
                    "is required on CPU, where it plays the device capacity per rank; e.g. tune.memory_budget_mb=64",
                )
            budget = device_capacity_mb(shape)
        cfg = replace(cfg, tune={"memory_budget_mb": budget})
        n0 = first_microbatches(cfg)
        plan = TunePlan(
            budget,
            n0=n0,
            activation_checkpointing=tuple(cfg.tune.activation_checkpointing),
            probes=tuple(cfg.tune.probes),
            margin=cfg.tune.margin,
            max_micro_batch=cfg.tune.max_micro_batch,
        )
        t = cfg.topology
        log.info(
            "tune: dp %d x pp %d x tp %d, budget %.1f MB per rank (%s); memory search at %d micro-batch(es) per step, "
            "activation checkpointing %s",
            t.dp,
            t.pp,
            t.tp,
            budget,
            "GPU capacity" if shape.use_gpu and cfg.tune.memory_budget_mb <= 0 else "tune.memory_budget_mb",
            n0,
            "/".join("on" if ac else "off" for ac in plan.searches),
        )
        host = ray.remote(num_cpus=0)(TrialHost).remote(cfg, shape)
        searcher = PlanSearcher(plan)
        start = time.perf_counter()
        tuner = tune.Tuner(
            # Trials only call the host: no CPU of their own (Tune wants some resource: a few bytes).
            tune.with_resources(tune.with_parameters(_trial, host=host), {"cpu": 0, "memory": 1024}),
            tune_config=tune.TuneConfig(search_alg=searcher, num_samples=MAX_TRIALS, max_concurrent_trials=1),
            run_config=tune.RunConfig(storage_path=str(out), name="ray_tune", verbose=0),
        )
        tuner.fit()
        wall = time.perf_counter() - start
    finally:
        if host is not None:
            try:
                ray.get(host.shutdown.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                pass
        if started_ray:
            ray.shutdown()
    summary = report.write(cfg, plan, out, wall, list(overrides))
    if plan.best is None:
        raise RayHybridError(
            f"no trial fitted tune.memory_budget_mb={budget:g} (even micro-batch {cfg.tune.probes[0]}); "
            f"see {out / 'tune_results.csv'}"
        )
    return summary


def tune_main(overrides: list[str], run_dir: str | Path | None = None) -> dict:
    """Compose, validate and tune (the `python -m rayhybrid.tune` entry point, for scripts)."""
    from rayhybrid.api import _ensure_logging, make_run_dir
    from rayhybrid.config.compose import compose, to_config

    node = compose(overrides, return_hydra_config=True)
    run_dir = Path(run_dir) if run_dir is not None else make_run_dir(Path(str(node.hydra.run.dir)))
    cfg = dataclasses.replace(to_config(node), run_dir=str(run_dir))
    if not cfg.tune.activation_checkpointing:
        raise ConfigError("tune.activation_checkpointing", "needs at least one setting, e.g. [false,true]")
    probes = tuple(cfg.tune.probes)
    if len(probes) != 2 or not 0 < probes[0] < probes[1]:
        raise ConfigError("tune.probes", f"must be two increasing positive sizes, e.g. [1,2]; got {list(probes)}")
    if cfg.tune.steps < 2:
        raise ConfigError("tune.steps", "must be at least 2 (memory and speed are read after the first step)")
    # The trials' configs, not the base one, must be valid (the batch settings are the trials').
    for ac in dict.fromkeys(cfg.tune.activation_checkpointing):
        first = {
            "micro_batch_size": probes[0],
            "num_microbatches": first_microbatches(cfg),
            "activation_checkpointing": ac,
        }
        validate(trial_config(cfg, first))
    _ensure_logging()
    return run_tune(cfg, overrides)
