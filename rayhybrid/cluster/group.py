"""A worker group: the replica placement groups and one actor per rank, in rank order."""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayhybrid.cluster.placement import ReplicaShape, create_replicas, placement_state, release
from rayhybrid.cluster.worker import CONTROL, TrainWorker, WorkerInfo
from rayhybrid.config.schema import Config, with_dp
from rayhybrid.errors import PlacementError, RankFailed, WorkerError
from rayhybrid.topology import Topology

log = logging.getLogger(__name__)

# After a failure, how long the workers still running get to notice it and leave the process
# group (they normally take well under a second: the failed rank's closed connections wake
# them; a killed stopped process takes Ray about 5s to end).
DRAIN_TIMEOUT_S = 30.0
# At start, once the replicas needed are placed, how long the others may take to join in.
START_GRACE_S = 2.0
# How long a worker blocked in a collective gets to answer a ping before it counts as hung.
PING_TIMEOUT_S = 5.0


class WorkerGroup:
    """`slots` replica placement groups (one per data-parallel replica the run may use) and the
    actors of the `dp` replicas in use, in rank order (DESIGN invariant 1). Unused slots stay
    reserved: while pending they show an autoscaler the demand, once placed they let the run
    grow. A fixed-size run has `slots == dp`."""

    def __init__(self, cfg: Config, shape: ReplicaShape, usable_dps: list[int] | None = None) -> None:
        self.cfg = cfg
        self.shape = shape
        self.usable = sorted(usable_dps or [cfg.topology.dp])
        self.slots = self.usable[-1]
        self.groups: list = []  # placement group per slot
        self.active: list[int] = []  # the slot of each data-parallel replica in use
        self.replicas: dict[int, list] = {}  # slot -> its pp*tp actors
        self.infos: list[WorkerInfo] = []
        self.descriptions: list[dict] = []
        self._actor_cls = ray.remote(concurrency_groups={CONTROL: 1})(TrainWorker)
        self._inflight: list = []  # the refs of the last call, for `recover`
        self._hung = False  # whether that call failed by making no progress

    @property
    def topology(self) -> Topology:
        t = self.cfg.topology
        return Topology(t.dp, t.pp, t.tp)

    @property
    def dp(self) -> int:
        return self.cfg.topology.dp

    @property
    def workers(self) -> list:
        return [actor for slot in self.active for actor in self.replicas[slot]]

    def fit(self, replicas: int) -> int:
        """The largest usable dp with at most `replicas` replicas (0 if none)."""
        return max((dp for dp in self.usable if dp <= replicas), default=0)

    def start(self, min_dp: int | None = None, timings: dict | None = None) -> None:
        """Reserve every slot, wait (at most `cluster.placement_timeout_s`) until `min_dp` of them
        are placed, start the largest usable dp on them, join the process group and build the
        model. `timings` gets `place_s` and `init_s`."""
        mark = time.perf_counter()
        min_dp = self.slots if min_dp is None else min_dp
        self.groups = create_replicas(self.shape, self.slots)
        timeout = self.cfg.cluster.placement_timeout_s
        refs = [pg.ready() for pg in self.groups]
        ready, rest = ray.wait(refs, num_returns=min_dp, timeout=timeout)
        if len(ready) < min_dp:
            release(self.groups)
            raise PlacementError(
                "cluster.placement_timeout_s",
                f"only {len(ready)} of {min_dp} replicas could be placed within {timeout:g}s "
                "(the cluster is busy or short of resources); free resources or raise cluster.placement_timeout_s",
            )
        # The rest may be a moment behind (placed together); give them that moment, not more.
        ray.wait(rest, num_returns=len(rest), timeout=min(START_GRACE_S, timeout))
        placed = self.placed_slots()
        self.active = placed[: self.fit(len(placed))]
        self.cfg = with_dp(self.cfg, len(self.active))
        placed_at = time.perf_counter()
        for slot in self.active:
            self.replicas[slot] = self._spawn_replica(slot)
        self._join()
        if timings is not None:
            timings.update(place_s=placed_at - mark, init_s=time.perf_counter() - placed_at)

    def placed_slots(self) -> list[int]:
        """Slots whose placement group is placed now (not pending, not being placed again)."""
        return [slot for slot, pg in enumerate(self.groups) if placement_state(pg) == "CREATED"]

    def resize(self, slots: list[int], timings: dict | None = None) -> None:
        """Use the replicas in `slots` (in this order): stop the actors of slots left out, start
        actors in the new ones, and join them all again (ranks and dp change; a checkpoint
        restores the state)."""
        mark = time.perf_counter()
        for slot in [s for s in self.active if s not in slots]:
            for actor in self.replicas.pop(slot):
                ray.kill(actor, no_restart=True)
        for slot in slots:
            if slot not in self.replicas:
                self.replicas[slot] = self._spawn_replica(slot)
        self.active = list(slots)
        self.cfg = with_dp(self.cfg, len(slots))
        self._join()
        if timings is not None:
            timings["init_s"] = timings.get("init_s", 0.0) + time.perf_counter() - mark

    def recover(self, timings: dict | None = None, min_dp: int | None = None) -> list[int]:
        """After a failed call: keep every worker that still answers, replace the ones that died
        or hung (in their own bundles, so the placement stays), and join them all again.

        A replica whose placement group is not placed again within `elastic.reschedule_timeout_s`
        (its node is gone for good) is dropped when `min_dp` allows it: the run shrinks to the
        largest usable dp. Returns the ranks replaced (numbered before any shrink). `timings`
        gets `teardown_s`, `place_s` and `init_s`."""
        mark = time.perf_counter()
        topo = self.topology
        dead: set[int] = set()
        if self._hung:
            dead |= self._unresponsive()
            for rank in dead:
                ray.kill(self.workers[rank], no_restart=True)
        # A worker whose call failed has left the process group, closing its connections; the
        # peers blocked on it then fail too, in a cascade. `reset` runs after each worker's
        # call has ended, and closes the connections of the workers whose call succeeded.
        workers = self.workers
        live = [rank for rank in range(len(workers)) if rank not in dead]
        resets = {rank: workers[rank].reset.remote() for rank in live}
        done, _ = ray.wait(list(resets.values()), num_returns=len(resets), timeout=DRAIN_TIMEOUT_S)
        for rank, ref in resets.items():
            if ref not in done:
                log.warning("rank %d did not leave the process group within %.0fs; replacing it", rank, DRAIN_TIMEOUT_S)
                ray.kill(workers[rank], no_restart=True)
                dead.add(rank)
                continue
            try:
                ray.get(ref)
            except RayError:
                dead.add(rank)
        _settle(self._inflight)
        torn_down = time.perf_counter()

        # Bundles whose node died are placed again by Ray, if the cluster has room.
        broken = sorted({self.active[topo.coord(rank).dp] for rank in dead})
        elastic = min_dp is not None
        wait_s = self.cfg.elastic.reschedule_timeout_s if elastic else self.cfg.cluster.placement_timeout_s
        refs = {slot: self.groups[slot].ready() for slot in broken}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
        lost = [slot for slot, ref in refs.items() if ref not in ready]
        if lost and not elastic:
            raise PlacementError(
                "cluster.placement_timeout_s",
                f"{len(lost)} replica(s) lost workers and could not be placed again within {wait_s:g}s; "
                "add nodes or raise cluster.placement_timeout_s",
            )
        placed = time.perf_counter()
        for rank in sorted(dead):
            slot, local = self.active[topo.coord(rank).dp], rank % (topo.pp * topo.tp)
            self.replicas[slot][local] = None
        keep = [slot for slot in self.active if slot not in lost]
        keep = keep[: self.fit(len(keep))]
        if len(keep) < (min_dp or 1):
            raise PlacementError(
                "elastic.min_dp",
                f"{len(self.active) - len(lost)} replica(s) left after losing {len(lost)}, below elastic.min_dp={min_dp}",
            )
        for slot in [s for s in self.active if s not in keep]:  # dropped: stop what is left of it
            for actor in self.replicas.pop(slot):
                if actor is not None:
                    ray.kill(actor, no_restart=True)
        for slot in keep:
            actors = self.replicas[slot]
            for local, actor in enumerate(actors):
                if actor is None:
                    actors[local] = self._spawn(slot, local)
        self.active = keep
        self.cfg = with_dp(self.cfg, len(keep))
        self._join()
        if timings is not None:
            timings.update(teardown_s=torn_down - mark, place_s=placed - torn_down, init_s=time.perf_counter() - placed)
        log.info("kept %d worker(s), replaced %d (ranks %s)", len(live) - len(dead & set(live)), len(dead),
                 ",".join(map(str, sorted(dead))) or "none")
        return sorted(dead)

    def _unresponsive(self) -> set[int]:
        """Ranks whose process does not answer a ping (stopped, wedged, holding the GIL)."""
        workers = self.workers
        busy = [rank for rank, ref in enumerate(self._inflight) if not _finished(ref)]
        pings = {rank: workers[rank].ping.remote() for rank in busy}
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

    def _spawn_replica(self, slot: int) -> list:
        return [self._spawn(slot, local) for local in range(self.shape.pp * self.shape.tp)]

    def _spawn(self, slot: int, local: int):
        """An actor for position `local` (stage-major) of the replica in `slot`."""
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.groups[slot], placement_group_bundle_index=local // self.shape.tp
        )
        return self._actor_cls.options(
            num_cpus=self.shape.cpus_per_rank,
            num_gpus=1 if self.shape.use_gpu else 0,
            scheduling_strategy=strategy,
            max_restarts=0,
        ).remote(self.cfg, 0, 1)

    def _join(self) -> None:
        """Every worker takes its rank, joins a new process group (a fresh port) and builds its
        part of the model."""
        workers = self.workers
        self.infos = self._get([w.info.remote() for w in workers])
        gpus_by_node: dict[str, list[str]] = defaultdict(list)
        for info in self.infos:
            gpus_by_node[info.node_id].extend(info.gpu_ids)
        master_port = self._get([workers[0].free_port.remote()])[0]
        master_addr = self.infos[0].ip
        self.descriptions = self._get(
            [
                w.setup.remote(
                    master_addr, master_port, tuple(sorted(set(gpus_by_node[info.node_id]), key=_gpu_key)),
                    rank=rank, cfg=self.cfg,
                )
                for rank, (w, info) in enumerate(zip(workers, self.infos))
            ]
        )
        self.infos = self._get([w.info.remote() for w in workers])  # with their new ranks

    def train(self, steps: int = 1, timeout_s: float | None = None) -> list[dict]:
        """Run `steps` optimizer steps on every rank; returns rank 0's metrics per step.
        A call that makes no progress for `timeout_s` counts as a failed (hung) worker."""
        results = self._get([w.train.remote(steps) for w in self.workers], timeout_s=timeout_s, what="step")
        per_replica = self.shape.pp * self.shape.tp
        merged = []
        for i, metrics in enumerate(results[0]):
            metrics = dict(metrics)
            # The sample ranges each replica's first stage read: [[start, count], ...] in dp order.
            metrics["samples"] = [results[d * per_replica][i].pop("samples_read") for d in range(self.dp)]
            metrics.pop("samples_read", None)
            for name in ("peak_mb", "activation_mb"):  # metrics.memory: every rank's, "rank<r>/stage<s>/<phase>"
                if name in metrics:
                    metrics[name] = {
                        f"rank{rank}/{key}": mb for rank, steps in enumerate(results) for key, mb in steps[i][name].items()
                    }
            bubbles = [steps[i]["bubble"] for steps in results if steps[i].get("bubble") is not None]
            metrics["bubble"] = sum(bubbles) / len(bubbles) if bubbles else None  # the pipeline's idle share
            if "trace" in metrics:  # metrics.trace_steps: every rank's spans
                metrics["trace"] = [event for steps in results for event in steps[i].get("trace", [])]
            merged.append(metrics)
        return merged

    def reconfigure(self, cfg: Config) -> None:
        """Join every worker again under `cfg` (same topology; other settings may change, e.g.
        the micro-batch size of a tuning trial); recovers the group first after a failed call."""
        t, now = cfg.topology, self.cfg.topology
        if (t.dp, t.pp, t.tp) != (now.dp, now.pp, now.tp):
            raise ValueError("reconfigure keeps dp, pp and tp; use resize for another dp")
        self.cfg = cfg
        if self._inflight and not all(_finished(ref) for ref in self._inflight) or self._failed():
            self.recover()
        else:
            self._join()

    def errors(self) -> dict[int, str]:
        """After a failed call: the one-line error of each rank whose call failed, once they
        have all ended (a failed rank's peers fail after it; waits at most DRAIN_TIMEOUT_S)."""
        refs = self._inflight
        ray.wait(refs, num_returns=len(refs), timeout=DRAIN_TIMEOUT_S)
        out = {}
        for rank, ref in enumerate(refs):
            if _finished(ref):
                try:
                    ray.get(ref)
                except RayTaskError as err:
                    out[rank] = _summary(err)
                except RayActorError as err:
                    out[rank] = f"worker died: {_summary(err)}"
        return out

    def _failed(self) -> bool:
        return bool(self._inflight) and bool(self.errors())

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
        self.replicas, self.active, self.groups = {}, [], []

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
