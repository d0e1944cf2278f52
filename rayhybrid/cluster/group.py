"""A worker group: the replica placement groups and one actor per rank, in rank order."""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayhybrid.cluster.placement import ReplicaShape, release, reserve_replicas
from rayhybrid.cluster.worker import TrainWorker, WorkerInfo
from rayhybrid.config.schema import Config
from rayhybrid.errors import WorkerError
from rayhybrid.topology import Topology

log = logging.getLogger(__name__)


class WorkerGroup:
    def __init__(self, cfg: Config, shape: ReplicaShape) -> None:
        self.cfg = cfg
        self.shape = shape
        t = cfg.topology
        self.topology = Topology(t.dp, t.pp, t.tp)
        self.groups = []
        self.workers: list = []
        self.infos: list[WorkerInfo] = []
        self.descriptions: list[dict] = []

    def start(self, timings: dict | None = None) -> None:
        """Place the replicas, start the actors, join the process group and build the model.
        `timings` gets `place_s` and `init_s`."""
        topo, shape = self.topology, self.shape
        mark = time.perf_counter()
        self.groups = reserve_replicas(shape, topo.dp, self.cfg.cluster.placement_timeout_s)
        placed = time.perf_counter()
        actor_cls = ray.remote(TrainWorker)
        for rank in range(topo.world_size):
            coord = topo.coord(rank)
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.groups[coord.dp], placement_group_bundle_index=coord.pp
            )
            self.workers.append(
                actor_cls.options(
                    num_cpus=shape.cpus_per_rank,
                    num_gpus=1 if shape.use_gpu else 0,
                    scheduling_strategy=strategy,
                    name=None,
                    max_restarts=0,
                ).remote(self.cfg, rank, topo.world_size)
            )
        self.infos = self._get([w.info.remote() for w in self.workers])
        gpus_by_node: dict[str, list[str]] = defaultdict(list)
        for info in self.infos:
            gpus_by_node[info.node_id].extend(info.gpu_ids)
        master_port = self._get([self.workers[0].free_port.remote()])[0]
        master_addr = self.infos[0].ip
        self.descriptions = self._get(
            [
                w.setup.remote(master_addr, master_port, tuple(sorted(set(gpus_by_node[info.node_id]), key=_gpu_key)))
                for w, info in zip(self.workers, self.infos)
            ]
        )
        if timings is not None:
            timings.update(place_s=placed - mark, init_s=time.perf_counter() - placed)

    def train(self, steps: int = 1, timeout_s: float | None = None) -> list[dict]:
        """Run `steps` optimizer steps on every rank; returns rank 0's metrics per step.
        A call that makes no progress for `timeout_s` counts as a failed (hung) worker."""
        results = self._get([w.train.remote(steps) for w in self.workers], timeout_s=timeout_s, what="step")
        return results[0]

    def save(self, root: str, keep: int, timeout_s: float | None = None) -> dict:
        return self._get([w.save.remote(root, keep) for w in self.workers], timeout_s=timeout_s, what="checkpoint save")[0]

    def load(self, path: str, meta: dict) -> int:
        return self._get([w.load.remote(path, meta) for w in self.workers])[0]

    def placement(self) -> list[dict]:
        """Rank -> node and bundle, for logs, tests and the plan."""
        out = []
        for info in self.infos:
            coord = self.topology.coord(info.rank)
            out.append(
                {
                    "rank": info.rank,
                    "dp": coord.dp,
                    "pp": coord.pp,
                    "tp": coord.tp,
                    "node_id": info.node_id,
                    "ip": info.ip,
                    "bundle": coord.pp,
                    "gpu_ids": list(info.gpu_ids),
                }
            )
        return out

    def shutdown(self, graceful: bool = True) -> None:
        if self.workers and graceful:
            try:
                ray.get([w.close.remote() for w in self.workers], timeout=30)
            except (RayError, TimeoutError):  # dead or hung workers: they are killed below
                pass
        for w in self.workers:
            ray.kill(w, no_restart=True)
        release(self.groups)
        self.workers, self.groups = [], []

    def _get(self, refs: list, timeout_s: float | None = None, what: str = "call") -> list:
        """`ray.get` that fails fast, naming the first rank whose call failed, or the first
        rank still busy when no rank has finished for `timeout_s`."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                raise WorkerError(
                    rank_of[pending[0]],
                    f"{what} made no progress for {timeout_s:g}s (fault.step_timeout_s); the worker is hung",
                )
            for ref in ready:
                try:
                    ray.get(ref)
                except RayTaskError as err:
                    raise WorkerError(rank_of[ref], _summary(err)) from None
                except RayActorError as err:
                    raise WorkerError(rank_of[ref], f"worker died: {_summary(err)}") from None
        return ray.get(refs)


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)


def _summary(err: Exception) -> str:
    """The remote error's last line (its type and message), not the whole traceback."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, Exception) and not isinstance(cause, RayError):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    if isinstance(err, RayActorError):
        # Ray's text runs to a paragraph of possible causes; keep what happened.
        text = " ".join(str(err).split())
        first = text.split(". ")[0].rstrip(".")
        exit_type = text.split("Worker exit type: ")[1].split()[0] if "Worker exit type: " in text else ""
        return f"{first} ({exit_type})" if exit_type else first
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__
