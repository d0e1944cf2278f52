"""Replica placement groups (docs/design.md, invariant 2): one data-parallel replica = one placement
group of `pp` bundles, each bundle holding the `tp` devices of one pipeline stage. A bundle never
spans nodes, so every tensor-parallel group sits on one node by construction; strategy PACK keeps
a replica's stages close together.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.errors import PlacementError
from rayhybrid.storage.store import one_line

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


def draining_nodes() -> dict[str, int]:
    """Ray's drain state (a spot node's preemption notice, an autoscaler scaling in): node id
    (hex) -> deadline in ms since the epoch (0: none). It comes from Ray's private state API:
    in a Ray where that moved, no node is ever seen draining (the run goes on, and a node's
    loss is recovered from as a failure), after one warning line."""
    try:
        from ray._private.state import state

        get = state.get_draining_nodes
    except (ImportError, AttributeError) as err:
        if not _drain_warned:
            _drain_warned.append(one_line(err))
            log.warning(
                "drain notices are off: this Ray's state API moved (%s); a preempted node's loss is recovered "
                "from as a failure (use ray==2.60.* to move off it in time)",
                _drain_warned[0],
            )
        return {}
    return dict(get())


_drain_warned: list[str] = []


def dead_nodes() -> set[str]:
    """Ids of the nodes the cluster has declared dead."""
    return {node["NodeID"] for node in ray.nodes() if not node.get("Alive")}


def wait_for_node_verdicts(suspects: set[str], timeout_s: float, probe_s: float = 5.0) -> set[str]:
    """Of the nodes in `suspects` (hosts of workers that cannot be reached), the ones that are
    dead. A node that lost power is declared dead only when Ray's health checks give up on it
    (seconds to a minute); until then its placement groups look placed and an actor started
    there never starts. A node that answers a probe task within `probe_s` is alive; for the
    others, wait (at most `timeout_s`) for Ray's verdict."""
    already = set(suspects) & dead_nodes()
    # A draining node runs no new task, a probe included: it is alive (and being left).
    suspects = set(suspects) - already - set(draining_nodes())
    if not suspects:
        return already
    probes = {
        node: _probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        for node in suspects
    }
    answered, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=probe_s)
    silent = {node for node, ref in probes.items() if ref not in answered}
    deadline = time.monotonic() + timeout_s
    while silent - dead_nodes() and time.monotonic() < deadline:
        time.sleep(0.2)
    for node in silent - dead_nodes():
        log.warning("node %s does not answer but Ray still counts it alive after %.0fs", node[:12], timeout_s)
    for ref in probes.values():
        with contextlib.suppress(RayError):
            ray.cancel(ref, force=True)
    return already | (silent & dead_nodes())


@ray.remote(num_cpus=0, max_retries=0)
def _probe() -> bool:
    return True


def bundles_that_fit(shape: ReplicaShape, nodes: list[dict]) -> int:
    """How many stage bundles the given nodes could hold at once (each bundle on one node)."""
    need = shape.bundle()
    total = 0
    for node in nodes:
        have = node.get("Resources", {})
        total += int(min(have.get(key, 0.0) // value for key, value in need.items() if value > 0))
    return total


AUTOSCALER_REPORT_WAIT_S = 10.0
"""How long to wait for the first report of a head's autoscaler monitor (it reports every few
seconds, and not before the raylets' first load report)."""


def autoscaled(wait_s: float = AUTOSCALER_REPORT_WAIT_S) -> bool:
    """Whether an autoscaler that can add nodes looks after the cluster: then nodes come when
    placement groups wait for them, and what the cluster has now says little.

    Every Ray head runs the autoscaler's monitor and publishes its status. Without an
    autoscaling config (`ray start --head` alone, a local Ray, `ray.cluster_utils.Cluster`) the
    monitor runs a read-only autoscaler that only mirrors the nodes there are; so the status
    alone says nothing, its node types do (`can_add_nodes`). A head this process started
    (`ray.init()` without an address: rayhybrid's own local Ray, a notebook's) has none, and
    is not asked. Autoscaler v2 (KubeRay's, or RAY_enable_autoscaler_v2=1) counts as one that
    can. It asks through Ray's private modules: in a Ray where they moved, the cluster counts
    as a fixed one (its capacity is checked), after one warning line."""
    deadline = time.monotonic() + wait_s
    try:
        from ray._private import worker
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.autoscaler.v2.utils import is_autoscaler_v2
        from ray.experimental.internal_kv import _internal_kv_get
    except ImportError as err:
        log.warning(
            "this Ray's autoscaler status moved (%s): the cluster is taken as fixed and its capacity checked "
            "(use ray==2.60.* for rayhybrid to wait for an autoscaler's nodes)",
            one_line(err),
        )
        return False
    try:
        if worker._global_node is not None and worker._global_node.head:
            return False
        if is_autoscaler_v2(fetch_from_server=True):
            return True
        while True:
            raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
            report = json.loads(raw).get("autoscaler_report") if raw else None
            if report or time.monotonic() >= deadline:
                return can_add_nodes(report)
            time.sleep(0.5)
    except Exception:  # noqa: BLE001 - no answer: count it as a fixed cluster
        return False


def can_add_nodes(report: dict | None) -> bool:
    """From the autoscaler monitor's report (`autoscaler_report` of its status): False for
    none, or for the read-only autoscaler of a cluster without an autoscaling config, whose
    node types are the nodes themselves (`format_readonly_node_type(node id)`, one per node);
    True for an autoscaler with node types of its own (those of its config)."""
    from ray.autoscaler._private.util import format_readonly_node_type

    if not report:
        return False
    mapping = report.get("node_type_mapping") or {}
    types = set(report.get("active_nodes") or {}) | set(report.get("pending_launches") or {}) | set(mapping.values())
    mirrored = {format_readonly_node_type(node) for node in mapping}
    return bool(types - mirrored)


def check_capacity(shape: ReplicaShape, dp: int, nodes: list[dict] | None = None) -> None:
    """Raise `PlacementError` when the cluster can never place `dp` replicas (counting its
    total resources, not what is free now). An autoscaled cluster is not checked: its nodes
    come on demand (up to cluster.placement_timeout_s)."""
    if nodes is None and autoscaled():
        log.info("the cluster has an autoscaler: waiting for it to add nodes as the replicas need them")
        return
    nodes = alive_nodes() if nodes is None else nodes
    device = "GPU" if shape.use_gpu else "CPU"
    per_rank = shape.rank_resources[device]
    ranks = dp * shape.pp * shape.tp
    asked = ranks * per_rank
    exist = sum(node.get("Resources", {}).get(device, 0.0) for node in nodes)
    largest = max((node.get("Resources", {}).get(device, 0.0) for node in nodes), default=0.0)
    hint = "lower topology.dp/pp/tp, add nodes" + (
        ", or raise cluster.num_cpus for a local Ray" if device == "CPU" else ""
    )
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


def create_replicas(shape: ReplicaShape, count: int, name: str = "rayhybrid", first: int = 0) -> list[PlacementGroup]:
    """Ask for `count` replica placement groups, named `name`-replica`first`..., placed as
    resources allow."""
    return [
        placement_group(shape.bundles(), strategy="PACK", name=f"{name}-replica{i}")
        for i in range(first, first + count)
    ]


def placement_state(pg: PlacementGroup) -> str:
    """PENDING, CREATED, RESCHEDULING (a node of it died) or REMOVED."""
    return placement_group_table(pg).get("state", "")


def release(groups: list[PlacementGroup]) -> None:
    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already gone with its node or the cluster
            log.debug("placement group already removed", exc_info=True)
