"""Where the ranks would run: reserve the replicas' placement groups on the Ray cluster, read
which node holds each bundle, and release them. The only module of `rayhybrid.plan` that
imports Ray (and only when a cluster address is given)."""

from __future__ import annotations

import os

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Topology
from rayhybrid.errors import PlacementError


def cluster_address(cfg: Config) -> str:
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")


def place(cfg: Config) -> dict:
    """{"ranks": [{"rank", "node_id", "node", "bundle", "replica"}], "device": "GPU"|"CPU"} for
    the placement training would get now: one placement group per data-parallel replica, one
    bundle (of tp devices) per pipeline stage, as `rayhybrid.cluster.group` asks for them."""
    import ray
    from ray.util.placement_group import placement_group_table

    from rayhybrid.cluster.connect import connect, resolve_shape
    from rayhybrid.cluster.placement import check_capacity, create_replicas, release

    t = cfg.topology
    was_connected = ray.is_initialized()
    connect(cfg)
    try:
        shape = resolve_shape(cfg)
        check_capacity(shape, t.dp)
        groups = create_replicas(shape, t.dp, name="rayhybrid-plan")
        try:
            timeout = cfg.cluster.placement_timeout_s
            ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=timeout)
            if len(ready) < len(groups):
                raise PlacementError(
                    "cluster.placement_timeout_s",
                    f"only {len(ready)} of {len(groups)} replicas could be placed within {timeout:g}s "
                    "(the cluster is busy or short of resources); free resources or raise cluster.placement_timeout_s",
                )
            bundles = [placement_group_table(pg)["bundles_to_node_id"] for pg in groups]
            nodes = {node["NodeID"]: node for node in ray.nodes()}
        finally:
            release(groups)
    finally:
        if not was_connected:
            ray.shutdown()  # disconnects this driver; the cluster keeps running
    topo = Topology(t.dp, t.pp, t.tp)
    ranks = []
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        node_id = bundles[c.dp][c.pp]  # bundle index = pipeline stage (cluster/reservation.py)
        ranks.append(
            {
                "rank": rank,
                "replica": c.dp,
                "bundle": c.pp,
                "node_id": node_id,
                "node": nodes.get(node_id, {}).get("NodeManagerAddress", "?"),
            }
        )
    return {"device": "GPU" if shape.use_gpu else "CPU", "ranks": ranks}
