"""Connecting to Ray: `cluster.address`, else `RAY_ADDRESS`, else a local Ray on 127.0.0.1."""

from __future__ import annotations

import logging
import os

import ray

from rayhybrid.cluster.placement import ReplicaShape, alive_nodes
from rayhybrid.config.schema import Config
from rayhybrid.errors import ConfigError
from rayhybrid.topology import Layout

log = logging.getLogger(__name__)


def connect(cfg: Config) -> bool:
    """Make sure Ray is initialised; returns True when this call started a local Ray (which
    the caller then shuts down). An already initialised Ray (a notebook, a test) is reused."""
    if ray.is_initialized():
        return False
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        return False
    ranks = Layout.of(cfg).world_size
    num_cpus = cfg.cluster.num_cpus or max(int(ranks * cfg.cluster.cpus_per_rank + 0.999), os.cpu_count() or 1)
    # Ray warns on every local start that token authentication (its default) is on; keep the
    # default and the terminal quiet (RAY_AUTH_MODE still chooses).
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(
        address="local",  # always a fresh local Ray, never a stray `ray start` cluster
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=True,
    )
    return True


def resolve_shape(cfg: Config) -> ReplicaShape:
    """The resources one replica needs; `cluster.use_gpu=auto` uses GPUs when the cluster has any."""
    gpus = sum(node.get("Resources", {}).get("GPU", 0.0) for node in alive_nodes())
    choice = str(cfg.cluster.use_gpu).lower()
    if choice == "true" and gpus == 0:
        raise ConfigError("cluster.use_gpu", "is true but the cluster has no GPUs; set cluster.use_gpu=auto or false")
    use_gpu = choice == "true" or (choice == "auto" and gpus > 0)
    t = cfg.topology
    return ReplicaShape(pp=t.pp, tp=t.tp, use_gpu=use_gpu, cpus_per_rank=cfg.cluster.cpus_per_rank)
