"""Replica placement groups (DESIGN invariant 2): one data-parallel replica = one placement
group of `pp` bundles, each bundle holding the `tp` devices of one pipeline stage. A bundle never
spans nodes, so every tensor-parallel group sits on one node by construction; strategy PACK keeps
a replica's stages close together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rayhybrid.errors import PlacementError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaShape:
    """What one replica asks of the cluster."""

    pp: int
    tp: int
    use_gpu: bool
    cpus_per_rank: float

    @property
    def rank_resources(self) -> dict[str, float]:
        res = {"CPU": self.cpus_per_rank}
        if self.use_gpu:
            res["GPU"] = 1
        return res

    def bundle(self) -> dict[str, float]:
        """One pipeline stage: tp ranks, all on one node."""
        return {key: value * self.tp for key, value in self.rank_resources.items()}

    def bundles(self) -> list[dict[str, float]]:
        return [self.bundle() for _ in range(self.pp)]


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def bundles_that_fit(shape: ReplicaShape, nodes: list[dict]) -> int:
    """How many stage bundles the given nodes could hold at once (each bundle on one node)."""
    need = shape.bundle()
    total = 0
    for node in nodes:
        have = node.get("Resources", {})
        total += int(min(have.get(key, 0.0) // value for key, value in need.items() if value > 0))
    return total


def check_capacity(shape: ReplicaShape, dp: int, nodes: list[dict] | None = None) -> None:
    """Raise `PlacementError` when the cluster can never place `dp` replicas (counting its
    total resources, not what is free now)."""
    nodes = alive_nodes() if nodes is None else nodes
    device = "GPU" if shape.use_gpu else "CPU"
    per_rank = shape.rank_resources[device]
    ranks = dp * shape.pp * shape.tp
    asked = ranks * per_rank
    exist = sum(node.get("Resources", {}).get(device, 0.0) for node in nodes)
    largest = max((node.get("Resources", {}).get(device, 0.0) for node in nodes), default=0.0)
    hint = "lower topology.dp/pp/tp, add nodes" + (", or raise cluster.num_cpus for a local Ray" if device == "CPU" else "")
    if shape.bundle()[device] > largest:
        raise PlacementError(
            "topology.tp",
            f"a tensor-parallel group of tp={shape.tp} needs {shape.bundle()[device]:g} {device}s on one node "
            f"but the largest node has {largest:g}; lower topology.tp to fit a node",
        )
    if bundles_that_fit(shape, nodes) < dp * shape.pp:
        raise PlacementError(
            "topology",
            f"{ranks} ranks (dp={dp} x pp={shape.pp} x tp={shape.tp}) ask for {asked:g} {device}s "
            f"({per_rank:g} per rank, in groups of {shape.tp} per node) but the cluster has {exist:g} "
            f"on {len(nodes)} node(s); {hint}",
        )


def create_replicas(shape: ReplicaShape, count: int, name: str = "rayhybrid") -> list[PlacementGroup]:
    """Ask for `count` replica placement groups; they are placed as resources allow."""
    return [placement_group(shape.bundles(), strategy="PACK", name=f"{name}-replica{i}") for i in range(count)]


def placement_state(pg: PlacementGroup) -> str:
    """PENDING, CREATED, RESCHEDULING (a node of it died) or REMOVED."""
    return placement_group_table(pg).get("state", "")


def release(groups: list[PlacementGroup]) -> None:
    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already gone with its node or the cluster
            log.debug("placement group already removed", exc_info=True)
