"""What a tuning trial may be, free of Ray: its training config, the micro-batch sizes a fixed
global batch allows, and the planner's memory prediction for it (rayhybrid/plan/).

A point is a dict of `Point` fields (trials.py): the batch shape (`micro_batch_size`,
`num_microbatches`), `activation_checkpointing`, and for a layout search the topology
(`dp`, `pp`, `tp`, `schedule`, `stages_per_rank`, `dp_shard`); what it leaves out is the base
config's.

    cfg_t = trial_config(cfg, point)
    planned_peak_mb(cfg_t, cuda=False)                      # None: the model has no memory model
    sizes = batch_sizes(cfg, per_replica=8)                 # [1, 2, 4, 8] that pass the checks
    largest_planned(cfg, point_of, sizes, limit_mb=6.0)     # the largest whose plan fits
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from rayhybrid.config.compose import replace
from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import check_config

TOPOLOGY_FIELDS = ("dp", "pp", "tp", "schedule", "stages_per_rank", "dp_shard")

MB = 2**20


def topology_fields(cfg: Config) -> dict:
    """The config's topology as a point's fields (TOPOLOGY_FIELDS)."""
    return {k: getattr(cfg.topology, k) for k in TOPOLOGY_FIELDS}


def trial_config(cfg: Config, point: dict) -> Config:
    """The training config of one trial: the point's topology (when it has one) and batch shape,
    memory metrics on, no evaluation (so no checkpoint.keep_best either: a trial saves no
    checkpoint), no experiment trackers (a trial logs to none; their checks would need wandb,
    mlflow and a W&B key where it runs)."""
    topology = {k: point[k] for k in TOPOLOGY_FIELDS if point.get(k) is not None}
    if topology:
        cfg = replace(cfg, topology=topology)
    mb, n = point["micro_batch_size"], point["num_microbatches"]
    return replace(
        cfg,
        train={
            "micro_batch_size": mb,
            "global_batch_size": cfg.topology.dp * mb * n,
            "activation_checkpointing": point["activation_checkpointing"],
            "offload_activations": point.get("offload_activations", cfg.train.offload_activations),
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
        fault={"standby": 0},  # a standby's imports would share the CPU with the measured steps
    )


def is_valid(cfg: Config) -> bool:
    """Whether a trial's config passes the config's checks (`rayhybrid.preflight.check_config`:
    pure, no file read). What the trials share in the world, the data and the stores, is checked
    once per command, not per candidate."""
    try:
        check_config(cfg)
    except ConfigError:
        return False
    return True


def planned_peak_mb(cfg: Config, cuda: bool = False, host: tuple[float, int] | None = None) -> float | None:
    """The planner's peak memory of the busiest rank in MB, what must fit the device: on CPU the
    live tensor bytes (`python -m rayhybrid.plan`'s `memory.max_mb`), on CUDA what the caching
    allocator reserves (`memory.max_reserved_mb`: the trials' limit compares reserved peaks
    too); None when the model has no memory model (ModelSpec.memory is None). `host`: a node's
    host memory (MB) and the ranks on it; a point whose offloaded activations
    (train.offload_activations) are planned over it fits no budget (inf)."""
    from rayhybrid.plan import estimate as est
    from rayhybrid.plan.dry_run import host_memory_mb
    from rayhybrid.plan.peak_memory import rank_memory

    if not est.has_memory_model(cfg):
        return None
    if host and host[0] and host_memory_mb(cfg, cuda) * host[1] > host[0]:
        return math.inf
    ranks = [rank_memory(cfg, r, cuda=cuda) for r in range(cfg.topology.pp)]
    return max(m.reserved if cuda else m.total for m in ranks) / MB


def batch_sizes(cfg: Config, per_replica: int, point: dict | None = None) -> list[int]:
    """The micro-batch sizes that divide a replica's share of a fixed global batch and make a
    valid trial (e.g. 1F1B needs at least pp micro-batches), smallest first."""
    base = {"activation_checkpointing": False, **(point or {})}
    return [
        m
        for m in range(1, per_replica + 1)
        if per_replica % m == 0
        and is_valid(trial_config(cfg, {**base, "micro_batch_size": m, "num_microbatches": per_replica // m}))
    ]


def largest_planned(
    cfg: Config,
    point_of: Callable[[int], dict],
    limit_mb: float,
    sizes: list[int] | None = None,
    cap: int = 4096,
    cuda: bool = False,
    host: tuple[float, int] | None = None,
) -> int:
    """The largest micro-batch size (of `sizes`, or up to `cap`) whose planned peak is at most
    `limit_mb`; 0 when none, or when the model has no memory model. Planned memory grows with
    the micro-batch size, so this bisects."""
    sizes = sizes if sizes is not None else range(1, cap + 1)

    def fits(m: int) -> bool:
        peak = planned_peak_mb(trial_config(cfg, point_of(m)), cuda=cuda, host=host)
        return peak is not None and peak <= limit_mb

    lo, hi = 0, len(sizes)  # sizes[:lo] fit, sizes[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            lo = mid + 1
        else:
            hi = mid
    return sizes[lo - 1] if lo else 0


def planned_probes(largest: int, default: tuple[int, int]) -> tuple[int, int]:
    """Probes at the planner's largest size and half of it (the line is then fitted where it is
    used); the defaults when the planner has nothing to say or puts the answer below 2."""
    return (max(1, largest // 2), largest) if largest >= 2 else default
