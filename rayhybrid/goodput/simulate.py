"""Run the chosen strategies on the same failure traces and sum up what each kept and lost.

result = simulate(compose_goodput(["gpus=4096", "failures=llama3"]))
result.strategies["peer_heal"].effective_time
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from rayhybrid.config.goodput import STRATEGIES, GoodputConfig, Strategy
from rayhybrid.driver.policies import FailurePolicy
from rayhybrid.errors import ConfigError
from rayhybrid.goodput.engine import CAUSES, Job, Outcome, Simulation, shard_heals
from rayhybrid.goodput.failures import Category, categories, draw_trace, job_rate_per_s
from rayhybrid.goodput.interval import optimal_interval


@dataclass(frozen=True)
class StrategyResult:
    """One strategy, as means over the traces (effective_time's range over them too)."""

    effective_time: float
    effective_time_range: tuple[float, float]
    checkpoint_interval_s: float
    recommended_checkpoint_interval_s: float
    gpu_hours_lost: dict[str, float]
    counts: dict[str, float]
    """Per trace: failures that reached the run, restarts, heals, fallbacks, shrinks, grows."""
    min_dp: int
    stopped: list[str]
    """Why the run gave up, one line per trace that did (empty: none did)."""


@dataclass(frozen=True)
class Result:
    gpus_used: int
    dp: int
    job_mtbf_hours: float
    failures_per_trace: float
    strategy: str
    """The strategy setting; `recommended_checkpoint_interval_s` is for it (restart_all under all)."""
    recommended_checkpoint_interval_s: float
    strategies: dict[str, StrategyResult] = field(default_factory=dict)


def build_job(cfg: GoodputConfig) -> tuple[Job, int]:
    """The layout (whole replicas of replica_gpus), the failures and the policies; and the GPUs
    the job uses."""
    dp = cfg.gpus // cfg.replica_gpus
    gpus = dp * cfg.replica_gpus
    if cfg.elastic.min_dp > dp:
        raise ConfigError("elastic.min_dp", f"is {cfg.elastic.min_dp}, over the job's dp of {dp}; lower it")
    job = Job(
        dp=dp,
        nodes_per_replica=cfg.replica_gpus // cfg.gpus_per_node,
        categories=categories(cfg, gpus),
        costs=cfg.costs,
        spare_nodes=cfg.spares.nodes,
        repair_s=cfg.spares.repair_hours * 3600.0,
        seconds=cfg.days * 86400.0,
        failure_policy=FailurePolicy(max_restarts=cfg.fault.max_restarts),
        min_dp=cfg.elastic.min_dp,
    )
    return job, gpus


def fallback_mtbf_s(strategy: Strategy, job: Job, gpus: int) -> float:
    """Mean seconds between failures that send `strategy` back to its checkpoint. Every failure
    does, except with peer healing, where rayhybrid's `HealPolicy` says which, asked as the
    simulation asks it (`shard_heals`): a failure of a category falls back when the policy finds
    no copy of the failed shard with the failed replica's copy lost; one that strikes while a heal
    is under way (within detection + costs.heal_s of a heal: first order, one heal at a time)
    and on another replica (chance (dp-1)/dp) when it finds none with that heal's replica lost too."""
    rate = job_rate_per_s(job.categories, gpus)
    if not strategy.heal:
        return 1.0 / rate
    replicas = range(job.dp)

    def falls_back(c: Category, lost: set[int]) -> bool:
        return not shard_heals(job.heal_policy, replicas, lost, c.peers_survive)

    alone = {c.name: falls_back(c, {0}) for c in job.categories}
    during = {c.name: falls_back(c, {0, 1}) if job.dp > 1 else alone[c.name] for c in job.categories}
    healing = [c for c in job.categories if not alone[c.name]]
    heal_rate = job_rate_per_s(healing, gpus)
    window = job.costs.heal_s + sum(
        (job.costs.hang_detect_s if c.hang else job.costs.detect_s) * c.per_gpu_hour for c in healing
    ) / max(sum(c.per_gpu_hour for c in healing), 1e-300)
    overlap = -math.expm1(-heal_rate * window) * (job.dp - 1) / job.dp
    fallback = sum(
        job_rate_per_s([c], gpus) * (alone[c.name] + overlap * (during[c.name] - alone[c.name])) for c in job.categories
    )
    return 1.0 / fallback if fallback > 0 else math.inf


def recommended_interval(strategy: Strategy, job: Job, gpus: int) -> float:
    """The work between saves that maximises Daly's form for this strategy's checkpoint
    fallbacks, no shorter than a step and no longer than the run."""
    best = optimal_interval(job.costs.save_s, fallback_mtbf_s(strategy, job, gpus), job.seconds)
    return max(job.costs.step_s, best)


def summarize(outcomes: list[Outcome], recommended: float, gpus: int) -> StrategyResult:
    effective = [o.effective_time for o in outcomes]
    n = len(outcomes)
    names = ("failures", "restarts", "heals", "fallbacks", "shrinks", "grows")
    return StrategyResult(
        effective_time=statistics.fmean(effective),
        effective_time_range=(min(effective), max(effective)),
        checkpoint_interval_s=outcomes[0].interval_s,
        recommended_checkpoint_interval_s=recommended,
        gpu_hours_lost={c: sum(o.lost[c] for o in outcomes) / n * gpus / 3600.0 for c in CAUSES},
        counts={k: sum(getattr(o, k) for o in outcomes) / n for k in names},
        min_dp=min(o.min_dp for o in outcomes),
        stopped=[o.stopped for o in outcomes if o.stopped],
    )


def simulate(cfg: GoodputConfig) -> Result:
    """Every chosen strategy on the traces of seeds seed .. seed+seeds-1."""
    job, gpus = build_job(cfg)
    names = list(STRATEGIES) if cfg.strategy == "all" else [cfg.strategy]
    recommended = {name: recommended_interval(STRATEGIES[name], job, gpus) for name in names}
    interval = {name: cfg.checkpoint.interval_s or recommended[name] for name in names}
    outcomes: dict[str, list[Outcome]] = {name: [] for name in names}
    drawn = 0
    for seed in range(cfg.seed, cfg.seed + cfg.seeds):
        try:
            trace = draw_trace(job.categories, gpus, job.dp * job.nodes_per_replica, job.seconds, seed)
        except ValueError as err:
            raise ConfigError("failures", f"{err}; simulate fewer days or a longer failures.mtbf_hours") from None
        drawn += len(trace.times)
        for name in names:
            outcomes[name].append(Simulation(STRATEGIES[name], job, interval[name]).run(trace))
    return Result(
        gpus_used=gpus,
        dp=job.dp,
        job_mtbf_hours=1.0 / job_rate_per_s(job.categories, gpus) / 3600.0,
        failures_per_trace=drawn / cfg.seeds,
        strategy=cfg.strategy,
        recommended_checkpoint_interval_s=recommended["restart_all" if cfg.strategy == "all" else cfg.strategy],
        strategies={name: summarize(outcomes[name], recommended[name], gpus) for name in names},
    )
