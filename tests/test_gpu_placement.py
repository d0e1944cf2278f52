"""GPUs placed right, shown without a GPU: a two-node `ray.cluster_utils.Cluster` whose nodes
declare 4 GPUs each (none exist; Ray hands out their ids all the same). The run's worker group
is built as the driver builds it, and every rank reports from inside its process what Ray gave
it and the device and backend that `setup` would choose (`choose_device`, which `_join` uses):
each rank of a node holds a GPU of its own, every tensor-parallel group sits on one node, each
pipeline stage's ranks sit on the node of their placement-group bundle, and the backend is
NCCL. Each rank stops where `setup` would join the process group, so CUDA never starts."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from ray.util.placement_group import placement_group_table

from benchmarks.clusters import local_cluster
from rayhybrid.cluster.connect import resolve_shape
from rayhybrid.cluster.group import WorkerGroup
from rayhybrid.cluster.placement import alive_nodes, check_capacity
from rayhybrid.cluster.worker import TrainWorker
from rayhybrid.config.compose import compose, to_config
from rayhybrid.config.topology import Layout
from rayhybrid.parallel.mesh import choose_device, select_backend

NODES, GPUS = 2, 4


def test_choose_device():
    """Pure: what `_join` sets up, from the rank's own GPUs and those its node's ranks hold."""
    cpu = choose_device((), ())
    assert (str(cpu), cpu.cuda_visible_devices, cpu.backend) == ("cpu", None, "gloo")
    mine = choose_device(("2",), ("0", "1", "2", "3"))
    assert (str(mine), mine.index, mine.cuda_visible_devices, mine.backend) == ("cuda:2", 2, "0,1,2,3", "nccl")
    assert mine.device == torch.device("cuda", 2) and select_backend(mine.device) == "nccl"  # what _join joins with
    alone = choose_device(("5",))  # no node list: the rank sees its own GPU only
    assert (str(alone), alone.cuda_visible_devices) == ("cuda:0", "5")
    with pytest.raises(ValueError, match="not among"):
        choose_device(("7",), ("0", "1"))


def probe_worker():
    """The actor class of a rank that, where `setup` would start CUDA and join the process
    group, reports where it runs and what it would choose instead (`TrainWorker.placement`).
    Made here, so that Ray ships the class itself (the workers cannot import this module)."""

    class ProbeWorker(TrainWorker):
        # It builds no trainer and joins no process group: nothing to import (seconds of a
        # rank's start: torch, the trainer) and nothing to reset.
        def warm_up(self) -> None:
            pass

        def reset(self, keep: bool = True) -> None:
            pass

        def host_store(self, world_size: int) -> int:  # no rendezvous: nothing joins
            return 0

        def _join(self, master_addr: str, master_port: int, visible_gpus: tuple[str, ...], generation: int) -> dict:
            return self.placement(visible_gpus)

    return ProbeWorker


@pytest.fixture(scope="module")
def gpu_nodes():
    with pytest.MonkeyPatch.context() as env:
        # Ray refuses to declare more GPUs than CUDA_VISIBLE_DEVICES lists (a GPU machine's).
        env.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        # No CPUs on the head, so every rank lands on a node with GPUs.
        with local_cluster(head_cpus=0, node_cpus=[GPUS] * NODES, node_gpus=GPUS) as (cluster, _):
            yield cluster


def probe(overrides: list[str]) -> tuple[Layout, list[dict], list[dict[int, str]]]:
    """Start the run's worker group as the driver does (shape, capacity check, placement groups,
    one actor per rank in its bundle, `setup` on every rank with the node's GPUs); returns the
    layout, each rank's report (in rank order) and each replica's bundle -> node."""
    cfg = to_config(compose([*overrides, "cluster.use_gpu=true", "cluster.cpus_per_rank=1"]))
    shape = resolve_shape(cfg)
    assert shape.use_gpu
    check_capacity(shape, cfg.topology.dp, alive_nodes())
    group = WorkerGroup(cfg, shape, actor_cls=probe_worker())  # the only change: each rank stops before CUDA
    try:
        group.start()
        groups = group.reservation.groups
        bundles = [placement_group_table(groups[slot])["bundles_to_node_id"] for slot in group.slots]
        return Layout.of(group.cfg), group.descriptions, bundles
    finally:
        group.shutdown(graceful=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "topology", [["+topology=dp2_pp2_tp2"], ["topology.pp=2", "topology.tp=4"]], ids=["dp2_pp2_tp2", "pp2_tp4"]
)
def test_ranks_get_their_own_gpu_and_nccl_where_the_plan_says(gpu_nodes, topology):
    layout, reports, bundles = probe(topology)
    assert [r["rank"] for r in reports] == list(range(layout.world_size)) == list(range(NODES * GPUS))
    on_node, tp_groups = defaultdict(list), defaultdict(set)
    for r in reports:
        c = layout.topology.coord(r["rank"])
        on_node[r["node_id"]].append(r)
        tp_groups[c.dp, c.pp].add(r["node_id"])
        # The stage's ranks are on the node that holds its bundle (bundle index = stage).
        assert r["node_id"] == bundles[c.dp][c.pp], (r, bundles)
        # One GPU from Ray; the device is that GPU, by its place in what the rank sees; NCCL.
        assert len(r["gpu_ids"]) == 1, r
        visible = r["cuda_visible_devices"].split(",")
        assert r["device"] == f"cuda:{visible.index(r['gpu_ids'][0])}", r
        assert r["backend"] == "nccl", r
        assert not r["cuda_initialized"], r
    assert all(len(nodes) == 1 for nodes in tp_groups.values()), tp_groups
    assert len(on_node) == NODES
    for node, ranks in on_node.items():
        gpus = [r["gpu_ids"][0] for r in ranks]
        assert len(set(gpus)) == len(gpus) == GPUS, (node, gpus)  # distinct, every GPU used
        # Every rank of a node sees all of the node's GPUs (NCCL's peer-to-peer links), in one
        # order, so distinct GPUs are distinct device indices.
        assert {r["cuda_visible_devices"] for r in ranks} == {",".join(sorted(gpus, key=int))}, ranks
        assert len({r["device"] for r in ranks}) == GPUS, ranks
