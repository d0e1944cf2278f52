"""A worker group: the replica placement groups and one actor per rank, in rank order."""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayhybrid.cluster.placement import ReplicaShape, release, reserve_replicas
from rayhybrid.cluster.worker import CONTROL, TrainWorker, WorkerInfo
from rayhybrid.config.schema import Config
from rayhybrid.errors import PlacementError, RankFailed, WorkerError
from rayhybrid.topology import Topology

log = logging.getLogger(__name__)

# After a failure, how long the workers still running get to notice it and leave the process
# group (they normally take well under a second: the failed rank's closed connections wake
# them; a killed stopped process takes Ray about 5s to end).
DRAIN_TIMEOUT_S = 30.0
# How long a worker blocked in a collective gets to answer a ping before it counts as hung.
PING_TIMEOUT_S = 5.0


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
        self._actor_cls = ray.remote(concurrency_groups={CONTROL: 1})(TrainWorker)
        self._inflight: list = []  # the refs of the last call, for `recover`
        self._hung = False  # whether that call failed by making no progress

    def start(self, timings: dict | None = None) -> None:
        """Place the replicas, start the actors, join the process group and build the model.
        `timings` gets `place_s` and `init_s`."""
        mark = time.perf_counter()
        self.groups = reserve_replicas(self.shape, self.topology.dp, self.cfg.cluster.placement_timeout_s)
        placed = time.perf_counter()
        self.workers = [self._spawn(rank) for rank in range(self.topology.world_size)]
        self._join()
        if timings is not None:
            timings.update(place_s=placed - mark, init_s=time.perf_counter() - placed)

    def recover(self, timings: dict | None = None) -> list[int]:
        """After a failed call: keep every worker that still answers, replace the ones that died
        or hung (in their own bundles, so the placement stays), and join them all again.
        Returns the ranks replaced. `timings` gets `teardown_s`, `place_s` and `init_s`."""
        mark = time.perf_counter()
        dead: set[int] = set()
        if self._hung:
            dead |= self._unresponsive()
            for rank in dead:
                ray.kill(self.workers[rank], no_restart=True)
        # A worker whose call failed has left the process group, closing its connections; the
        # peers blocked on it then fail too, in a cascade. `reset` runs after each worker's
        # call has ended, and closes the connections of the workers whose call succeeded.
        live = [rank for rank in range(len(self.workers)) if rank not in dead]
        resets = {rank: self.workers[rank].reset.remote() for rank in live}
        drain_s = DRAIN_TIMEOUT_S
        done, _ = ray.wait(list(resets.values()), num_returns=len(resets), timeout=drain_s)
        for rank, ref in resets.items():
            if ref not in done:
                log.warning("rank %d did not leave the process group within %.0fs; replacing it", rank, drain_s)
                ray.kill(self.workers[rank], no_restart=True)
                dead.add(rank)
                continue
            try:
                ray.get(ref)
            except RayError:
                dead.add(rank)
        _settle(self._inflight)
        torn_down = time.perf_counter()
        # Bundles whose node died are placed again by Ray; wait for them before starting.
        replicas = sorted({self.topology.coord(rank).dp for rank in dead})
        _, pending = ray.wait(
            [self.groups[d].ready() for d in replicas], num_returns=len(replicas),
            timeout=self.cfg.cluster.placement_timeout_s,
        )
        if pending:
            raise PlacementError(
                "cluster.placement_timeout_s",
                f"{len(pending)} replica(s) lost workers and could not be placed again within "
                f"{self.cfg.cluster.placement_timeout_s:g}s; add nodes or raise cluster.placement_timeout_s",
            )
        placed = time.perf_counter()
        for rank in sorted(dead):
            self.workers[rank] = self._spawn(rank)
        self._join()
        if timings is not None:
            timings.update(teardown_s=torn_down - mark, place_s=placed - torn_down, init_s=time.perf_counter() - placed)
        log.info("kept %d worker(s), replaced %d (ranks %s)", len(self.workers) - len(dead), len(dead),
                 ",".join(map(str, sorted(dead))) or "none")
        return sorted(dead)

    def _unresponsive(self) -> set[int]:
        """Ranks whose process does not answer a ping (stopped, wedged, holding the GIL)."""
        busy = [rank for rank, ref in enumerate(self._inflight) if not _finished(ref)]
        pings = {rank: self.workers[rank].ping.remote() for rank in busy}
        done, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=PING_TIMEOUT_S)
        silent = set()
        for rank, ref in pings.items():
            try:
                if ref not in done:
                    raise TimeoutError
                ray.get(ref)
            except (RayError, TimeoutError):
                silent.add(rank)
        return silent

    def _spawn(self, rank: int):
        coord = self.topology.coord(rank)
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.groups[coord.dp], placement_group_bundle_index=coord.pp
        )
        return self._actor_cls.options(
            num_cpus=self.shape.cpus_per_rank,
            num_gpus=1 if self.shape.use_gpu else 0,
            scheduling_strategy=strategy,
            max_restarts=0,
        ).remote(self.cfg, rank, self.topology.world_size)

    def _join(self) -> None:
        """Every worker joins a new process group (a fresh port) and builds its model."""
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
        self._inflight, self._hung = refs, False
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                self._hung = True
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


def _settle(refs: list) -> None:
    """Collect the outcome of a failed call's refs (all have ended or their actor is gone), so
    Ray does not report the expected errors as unhandled."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=5)
    for ref in done:
        try:
            ray.get(ref)
        except RayError:
            pass


def _finished(ref) -> bool:
    return bool(ray.wait([ref], timeout=0)[0])


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)


def _summary(err: Exception) -> str:
    """The remote error's last line (its type and message), not the whole traceback."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, RankFailed):
        return str(cause)
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
