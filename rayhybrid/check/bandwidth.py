"""The all-reduce bandwidth a run will get, measured on the backend it will use (gloo on CPU,
NCCL on GPUs): inside each node (2 processes there, all nodes at once) and between nodes (one
process per node, each node with the next, pairs that share no node at once). A few MB, a few
iterations after a warm-up; the figure is the bus bandwidth, as nccl-tests count it (bytes x
2(n-1)/n per second, which ring algorithms put on each link).

    figures = measure(nodes, gpu=False)      # node id -> {"intra_gbps": ..., "inter_gbps": ...}

The figures are held against what the run counts on (`expected`): cluster.intra_node_gbps and
cluster.inter_node_gbps, or the backend's default below. The planner counts bytes, not seconds
(rayhybrid/plan/estimate.py: each rank's bytes on the wire per step); these settings are the
bandwidth those bytes meet.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from datetime import timedelta

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.check.nodes import Node
from rayhybrid.check.problems import Problem
from rayhybrid.config.schema import Config
from rayhybrid.storage.store import one_line

DEFAULT_GBPS = {"nccl": (20.0, 5.0), "gloo": (0.5, 0.1)}
"""(inside a node, between nodes) in bus GB/s, when cluster.intra_node_gbps and
cluster.inter_node_gbps are 0: conservative figures (NCCL: PCIe inside a node, 50 Gb/s between
nodes; gloo: TCP on one host, 1 Gb/s Ethernet). Set the settings to what the hardware has
(NVLink: hundreds of GB/s; 400 Gb/s InfiniBand: about 45)."""
SHARE = 0.5
"""A figure under this share of what the run counts on is a problem."""
SIZE_MB, ITERATIONS, WARMUP = 16, 5, 2
TIMEOUT_S = 120.0


class Meter:
    """One process of a measurement: joins a process group of the nodes being measured,
    all-reduces a tensor a few times, and leaves it again."""

    def endpoint(self) -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def all_reduce(self, master: tuple[str, int], rank: int, world: int, gpu: bool, size_mb: int, iters: int) -> float:
        """Seconds per all-reduce of `size_mb` MB (the median of `iters`)."""
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        dist.init_process_group(
            "nccl" if gpu else "gloo",
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=TIMEOUT_S),
            **({"device_id": device} if gpu else {}),
        )
        try:
            x = torch.ones(size_mb * 2**20 // 4, device=device)
            times = []
            for i in range(WARMUP + iters):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                if gpu:
                    torch.cuda.synchronize()
                if i >= WARMUP:
                    times.append(time.perf_counter() - start)
            return statistics.median(times)
        finally:
            dist.destroy_process_group()


def expected(cfg: Config, gpu: bool) -> tuple[float, float]:
    """(inside a node, between nodes) in GB/s: the settings, or the backend's defaults."""
    intra, inter = DEFAULT_GBPS["nccl" if gpu else "gloo"]
    return cfg.cluster.intra_node_gbps or intra, cfg.cluster.inter_node_gbps or inter


def bus_gbps(seconds: float, world: int, size_mb: int) -> float:
    return size_mb * 2**20 * 2 * (world - 1) / world / seconds / 1e9


def rounds(count: int) -> list[list[tuple[int, int]]]:
    """Each node i with node i+1 (the last with the first when there are more than two), in
    rounds of pairs that share no node."""
    pairs = [(i, (i + 1) % count) for i in range(count if count > 2 else count - 1)]
    out: list[list[tuple[int, int]]] = []
    for pair in pairs:
        for batch in out:
            if not {n for p in batch for n in p} & set(pair):
                batch.append(pair)
                break
        else:
            out.append([pair])
    return out


def _group(meters: list, gpu: bool) -> list | str:
    """Refs of one all-reduce measurement among `meters` (rank = position), or why it could
    not start (a meter not placed or dead)."""
    try:
        master = ray.get(meters[0].endpoint.remote(), timeout=TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as err:
        return f"failed ({one_line(err)})"
    return [m.all_reduce.remote(master, r, len(meters), gpu, SIZE_MB, ITERATIONS) for r, m in enumerate(meters)]


def _start(nodes: list[Node], gpu: bool, per_node: dict[str, int]) -> dict[str, list]:
    cls = ray.remote(Meter)
    return {
        n.id: [
            cls.options(
                num_cpus=0,
                num_gpus=1 if gpu else 0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n.id, soft=False),
            ).remote()
            for _ in range(per_node[n.id])
        ]
        for n in nodes
    }


def measure(nodes: list[Node], gpu: bool) -> dict[str, dict]:
    """Node id -> {"intra_gbps", "inter_gbps"} (None where not measured: a node with one GPU
    has no pair inside it, a cluster of one node none between nodes; a str where it failed)."""
    per_node = {n.id: 2 if not gpu or n.gpus >= 2 else 1 for n in nodes}
    meters = _start(nodes, gpu, per_node)
    out = {n.id: {"intra_gbps": None, "inter_gbps": None} for n in nodes}
    try:
        inside = {n.id: _group(meters[n.id], gpu) for n in nodes if per_node[n.id] == 2}
        for node, refs in inside.items():
            out[node]["intra_gbps"] = _figure(refs, 2)
        best: dict[str, float | str] = {}
        for batch in rounds(len(nodes)):
            between = {pair: _group([meters[nodes[i].id][0] for i in pair], gpu) for pair in batch}
            for pair, refs in between.items():
                figure = _figure(refs, 2)
                for i in pair:
                    best[nodes[i].id] = _better(best.get(nodes[i].id), figure)
        for node, figure in best.items():
            out[node]["inter_gbps"] = figure
    finally:
        for actors in meters.values():
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
    return out


def _figure(refs: list | str, world: int) -> float | str:
    if isinstance(refs, str):
        return refs
    try:
        seconds = ray.get(refs, timeout=TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as err:
        return f"failed ({one_line(err)})"
    return round(bus_gbps(max(seconds), world, SIZE_MB), 3)


def _better(a: float | str | None, b: float | str) -> float | str:
    """A node's figure between nodes: the best of its pairs (a slow link of its neighbour's does
    not make it slow); a failure only when every pair failed."""
    if isinstance(a, float) and isinstance(b, float):
        return max(a, b)
    return a if isinstance(a, float) else b


def bandwidth_problems(node: Node, figures: dict, cfg: Config, gpu: bool) -> list[Problem]:
    intra, inter = expected(cfg, gpu)
    out = []
    for key, where, want, setting in (
        ("intra_gbps", "inside the node", intra, "cluster.intra_node_gbps"),
        ("inter_gbps", "to the other nodes", inter, "cluster.inter_node_gbps"),
    ):
        got = figures.get(key)
        if isinstance(got, str):
            out.append(Problem(node.name, f"the all-reduce {where} {got}", _FIX[key]))
        elif got is not None and got < SHARE * want:
            out.append(
                Problem(
                    node.name,
                    f"all-reduce {where} at {got:.3g} GB/s, under {SHARE:.0%} of the {want:g} GB/s the run counts "
                    f"on ({setting})",
                    f"{_FIX[key]}; or set {setting} to what the hardware has",
                )
            )
    return out


_FIX = {
    "intra_gbps": "check the node's GPU links (nvidia-smi topo -m, NCCL_P2P_DISABLE) or what else runs there",
    "inter_gbps": "check the network between the nodes (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, NCCL_IB_*, "
    "the NIC's speed)",
}
