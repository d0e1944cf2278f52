"""A worker group: the replica placement groups and one actor per rank, in rank order."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayhybrid.cluster import code
from rayhybrid.cluster import heal as peers
from rayhybrid.cluster.drain import DRAIN_TIMEOUT_S, Drained, drain, finished
from rayhybrid.cluster.merge import merge_steps
from rayhybrid.cluster.placement import (
    ReplicaShape,
    create_replicas,
    placement_state,
    release,
)
from rayhybrid.cluster.worker import CONTROL, TrainWorker, WorkerInfo
from rayhybrid.config.schema import Config, with_dp
from rayhybrid.config.topology import Layout
from rayhybrid.errors import ConfigError, PlacementTimeout, RankFailed, WorkerError
from rayhybrid.faults import Injection
from rayhybrid.storage.store import forwarded_env

if TYPE_CHECKING:
    from rayhybrid.trainer.results import RestoreResult, SaveResult, StepResult

log = logging.getLogger(__name__)

# At start, once the replicas needed are placed, how long the others may take to join in.
START_GRACE_S = 2.0


class _ForTheDriver:
    """Thin members the driver asks of a group (H2a's WorkerGroup owns them at merge): the
    slots in use, in data-parallel order, and peer healing's calls (rayhybrid/cluster/heal.py)."""

    slots = property(lambda self: tuple(self.active))
    held = peers.held
    heal = peers.heal
    trace = peers.trace


class WorkerGroup(_ForTheDriver):
    """`slots` replica placement groups (one per data-parallel replica the run may use) and the
    actors of the replicas in use, in rank order (docs/design.md, invariant 1). Unused slots
    stay reserved: while pending they show an autoscaler the demand, once placed they let the
    run grow. A fixed-size run has `slots == dp`.

    Start, resize and recovery are made of the same pieces:

        placed = group.reserve(needed)        # placement groups for every slot
        group.rebuild(slots)                  # actors for exactly these slots, joined in order
        drained = group.drain()               # after a failed call: what is dead, which slots
        lost = group.wait_placed(drained.broken, timeout_s)   # slots not placed again in time
    """

    def __init__(self, cfg: Config, shape: ReplicaShape, slots: int | None = None) -> None:
        self.cfg = cfg
        self.shape = shape
        self.num_slots = slots or cfg.topology.dp
        self.groups: list = []  # placement group per slot
        self.active: list[int] = []  # the slot of each data-parallel replica in use
        self.replicas: dict[int, list] = {}  # slot -> its pp*tp actors (None: to be replaced)
        self.infos: list[WorkerInfo] = []
        self.descriptions: list[dict] = []
        self._actor_cls = ray.remote(concurrency_groups={CONTROL: 1})(TrainWorker)
        # The driver's storage settings (AWS_*, GOOGLE_*, ...), for nodes started without them.
        self.env = forwarded_env()
        # The model's code for nodes without it (cluster.code), its sizes checked before
        # anything is placed; uploaded when actors start (rayhybrid/cluster/code.py).
        self.code = code.shipment(cfg)
        self._inflight: list = []  # the refs of the last call, for `drain`
        self.moves = 0  # replicas moved off draining nodes
        self._hung = False  # whether that call failed by making no progress
        self.store_host = None  # the worker serving the rendezvous of the last join

    @property
    def layout(self) -> Layout:
        return Layout.of(self.cfg)

    @property
    def dp(self) -> int:
        return self.cfg.topology.dp

    @property
    def workers(self) -> list:
        return [actor for slot in self.active for actor in self.replicas[slot]]

    def start(self) -> None:
        """A fixed-size group: reserve every slot, wait until all are placed, start on them."""
        self.rebuild(self.reserve(self.num_slots))

    def reserve(self, needed: int) -> list[int]:
        """Ask for a placement group per slot and wait (at most `cluster.placement_timeout_s`)
        until `needed` of them are placed; returns the placed slots. Releases them all and
        raises `PlacementTimeout` when too few are placed in time."""
        self.groups = create_replicas(self.shape, self.num_slots)
        timeout = self.cfg.cluster.placement_timeout_s
        refs = [pg.ready() for pg in self.groups]
        ready, rest = ray.wait(refs, num_returns=needed, timeout=timeout)
        if len(ready) < needed:
            self.shutdown()
            raise PlacementTimeout(
                f"only {len(ready)} of {needed} replicas could be placed within {timeout:g}s "
                "(cluster.placement_timeout_s; the cluster is busy or short of resources); "
                "free resources or raise cluster.placement_timeout_s"
            )
        # The rest may be a moment behind (placed together); give them that moment, not more.
        ray.wait(rest, num_returns=len(rest), timeout=min(START_GRACE_S, timeout))
        return self.placed_slots()

    def nodes_of(self, slots: list[int]) -> list[str]:
        """The nodes that the placement groups of `slots` are placed on."""
        nodes = []
        for slot in slots:
            table = ray.util.placement_group_table(self.groups[slot])
            nodes += [n for n in table.get("bundles_to_node_id", {}).values() if n and n not in nodes]
        return nodes

    def replace(self, slots: list[int]) -> None:
        """Move the replicas of `slots` off their nodes (a node being drained): stop their actors
        and give the slots new placement groups, pending until the cluster has room elsewhere
        (Ray places nothing new on a draining node). `rebuild` starts actors in them."""
        for slot in slots:
            self._stop(self.replicas.get(slot, []))
            self.replicas[slot] = [None] * self.layout.topology.replica_size
            release([self.groups[slot]])
            self.moves += 1  # a fresh name: the group released may keep its own a moment
            self.groups[slot] = create_replicas(self.shape, 1, name=f"rayhybrid-move{self.moves}", first=slot)[0]

    def placed_slots(self) -> list[int]:
        """Slots whose placement group is placed now (not pending, not being placed again)."""
        return [slot for slot, pg in enumerate(self.groups) if placement_state(pg) == "CREATED"]

    def rebuild(self, slots: list[int]) -> None:
        """Train on the replicas in `slots` (in this order: replica i is data-parallel rank i):
        stop the actors of slots left out, start actors where a slot has none or lost some,
        and join them all in a new process group (ranks and dp may change; a checkpoint
        restores the state). Every worker call is bounded in time (see `_join`)."""
        for slot in [s for s in self.active if s not in slots]:
            self._stop(self.replicas.pop(slot))
        size = self.layout.topology.replica_size
        starting = any(actor is None for slot in slots for actor in self.replicas.get(slot, [None]))
        # The code is uploaded again if Ray dropped it meanwhile (no actor referred to it).
        runtime_env = code.runtime_env(self.code, self.env) if starting else None
        for slot in slots:
            actors = self.replicas.setdefault(slot, [None] * size)
            for local, actor in enumerate(actors):
                if actor is None:
                    actors[local] = self._spawn(slot, local, runtime_env)
        self.active = list(slots)
        self.cfg = with_dp(self.cfg, len(slots))
        self._join()

    def drain(self) -> Drained:
        """After a failed call: what is dead, which slots are broken, which nodes are lost
        (rayhybrid/cluster/drain.py)."""
        return drain(self)

    def wait_placed(self, slots, timeout_s: float) -> set[int]:
        """Wait until the placement groups of `slots` are placed (again: Ray places the bundles
        of a dead node elsewhere when the cluster has room); returns the slots still not placed
        after `timeout_s`."""
        refs = {slot: self.groups[slot].ready() for slot in slots}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        return {slot for slot, ref in refs.items() if ref not in ready}

    def recover(self) -> list[int]:
        """Drain and rebuild on the same slots (a fixed-size group, as a tuning host keeps);
        returns the ranks replaced."""
        drained = self.drain()
        lost = self.wait_placed(drained.broken, self.cfg.cluster.placement_timeout_s)
        if lost:
            raise PlacementTimeout(not_placed_again(len(lost), self.cfg.cluster.placement_timeout_s))
        self.rebuild(self.active)
        return sorted(drained.dead)

    def _spawn(self, slot: int, local: int, runtime_env: dict | None):
        """An actor for position `local` (stage-major) of the replica in `slot`, in
        `runtime_env` (the shipped code, the forwarded settings)."""
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.groups[slot], placement_group_bundle_index=local // self.shape.tp
        )
        return self._actor_cls.options(
            runtime_env=runtime_env,
            num_cpus=self.shape.cpus_per_rank,
            num_gpus=1 if self.shape.use_gpu else 0,
            scheduling_strategy=strategy,
            max_restarts=0,
        ).remote(self.cfg, 0, 1)

    def _join(self) -> None:
        """Every worker takes its rank, joins a new process group (a fresh port) and builds its
        part of the model."""
        workers, timeout = self.workers, self.start_timeout_s
        self.infos = self._get([w.info.remote() for w in workers], timeout, "start")
        gpus_by_node: dict[str, list[str]] = defaultdict(list)
        for info in self.infos:
            gpus_by_node[info.node_id].extend(info.gpu_ids)
        # Rank 0 serves the rendezvous; the drain closes it when a rank is lost during the join.
        master_port = self._get([workers[0].host_store.remote(len(workers))], timeout, "start")[0]
        self.store_host = workers[0]
        master_addr = self.infos[0].ip
        log.debug("%d workers joining a process group at %s:%d", len(workers), master_addr, master_port)
        calls = [
            w.setup.remote(
                master_addr,
                master_port,
                tuple(sorted(set(gpus_by_node[info.node_id]), key=_gpu_key)),
                rank=rank,
                cfg=self.cfg,
            )
            for rank, (w, info) in enumerate(zip(workers, self.infos))
        ]
        self.descriptions = self._get(calls, timeout, "setup")
        self.infos = self._get([w.info.remote() for w in workers], timeout, "start")  # with their new ranks

    @property
    def start_timeout_s(self) -> float:
        """Starting a process, building a model or loading a checkpoint can take longer than a
        step: bounded by whichever of the step and placement timeouts is longer."""
        return max(self.cfg.fault.step_timeout_s, self.cfg.cluster.placement_timeout_s)

    def _stop(self, actors: list) -> None:
        for actor in actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)

    def train(
        self, steps: int = 1, timeout_s: float | None = None, inject: Injection | None = None
    ) -> list[StepResult]:
        """Run `steps` optimizer steps on every rank; returns each step's result, merged.
        A call that makes no progress for `timeout_s` counts as a failed (hung) worker.
        `inject`: a `fault.inject` fault for one rank to trigger at the start of the call."""
        results = self._get(self._calls("train", inject, steps), timeout_s=timeout_s, what="step")
        return merge_steps(results, self.dp, self.layout.topology.replica_size)

    def reconfigure(self, cfg: Config) -> None:
        """Join every worker again under `cfg` (same topology; other settings may change, e.g.
        the micro-batch size of a tuning trial); recovers the group first after a failed call."""
        t, now = cfg.topology, self.cfg.topology
        if (t.dp, t.pp, t.tp) != (now.dp, now.pp, now.tp):
            raise ValueError("reconfigure keeps dp, pp and tp; use rebuild for another dp")
        self.cfg = cfg
        if self._inflight and not all(finished(ref) for ref in self._inflight) or self._failed():
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
            if finished(ref):
                try:
                    ray.get(ref)
                except RayTaskError as err:
                    out[rank] = _summary(err)
                except RayActorError as err:
                    out[rank] = f"worker died: {_summary(err)}"
        return out

    def _failed(self) -> bool:
        return bool(self._inflight) and bool(self.errors())

    def save(self, root: str, keep: int, timeout_s: float | None = None, inject: Injection | None = None) -> SaveResult:
        """Start (async) or write (sync) a checkpoint; rank 0's record of it (trainer/checkpoint.py)."""
        return self._get(self._calls("save", inject, root, keep), timeout_s=timeout_s, what="checkpoint save")[0]

    def finished_saves(self, timeout_s: float | None = None) -> list[SaveResult]:
        """Wait for the checkpoint upload in flight, if any; rank 0's records of the saves that
        finished since the last report (committed, or failed with `error`)."""
        return self._get([w.finished_saves.remote() for w in self.workers], timeout_s, "checkpoint upload")[0]

    def _calls(self, method: str, inject: Injection | None, *args) -> list:
        """`method(*args)` on every worker, the injected fault's rank told to trigger it."""
        return [
            getattr(w, method).remote(*args, inject=inject.kind if inject and inject.rank == rank else None)
            for rank, w in enumerate(self.workers)
        ]

    def load(self, path: str, meta: dict) -> RestoreResult:
        return self._get([w.load.remote(path, meta) for w in self.workers], self.start_timeout_s, "restore")[0]

    def placement(self) -> list[dict]:
        """Rank -> node and bundle, for logs, tests and the plan."""
        out = []
        for info in self.infos:
            coord = self.layout.topology.coord(info.rank)
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
        """Stop every actor and release every placement group; safe on a half-built group."""
        workers = [w for slot in self.replicas for w in self.replicas[slot] if w is not None]
        if workers and graceful:
            try:
                ray.get([w.close.remote() for w in workers], timeout=30)
            except (RayError, TimeoutError):  # dead or hung workers: they are killed below
                pass
        self._stop(workers)
        release(self.groups)
        self.replicas, self.active, self.groups, self._inflight = {}, [], [], []

    def _get(self, refs: list, timeout_s: float | None = None, what: str = "call") -> list:
        """`ray.get` that fails fast, naming the rank that failed first (`first_failure`), or the
        first rank still busy when no rank has finished for `timeout_s`."""
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
                    if isinstance(err.cause, ConfigError):  # settings no restart can fix: exit 2
                        raise ConfigError(err.cause.setting, err.cause.message) from None
                    raise first_failure(_failures(refs)) from None
                except RayActorError:
                    raise first_failure(_failures(refs)) from None
        return ray.get(refs)


FAILURE_GRACE_S = 1.0
"""Once a rank's call has failed, how long to wait for the other ranks' outcomes before naming
the first failure (its peers fail within a fraction of a second, when it leaves the group)."""


def _failures(refs: list) -> list[tuple[int, str, float | None]]:
    """(rank, one-line error, when it happened; None for a worker that died) of every call in
    `refs` (in rank order) that failed, waiting up to FAILURE_GRACE_S for those still running."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=FAILURE_GRACE_S)
    out = []
    for rank, ref in enumerate(refs):
        if ref not in done:
            continue
        try:
            ray.get(ref)
        except RayTaskError as err:
            out.append((rank, _summary(err), getattr(err.cause, "at", None) or math.inf))
        except RayActorError as err:
            out.append((rank, f"worker died: {_summary(err)}", None))
    return out


def first_failure(failures: list[tuple[int, str, float | None]]) -> WorkerError:
    """The failure to report, of (rank, error, time) in rank order: a worker that died (its
    peers' errors are consequences: broken connections), else the error that happened first
    (an out-of-memory error, not the peer's "Connection closed by peer" after it), else the
    lowest rank."""
    died = [f for f in failures if f[2] is None]
    rank, message, _ = died[0] if died else min(failures, key=lambda f: (f[2], f[0]))
    return WorkerError(rank, message)


def not_placed_again(count: int, wait_s: float) -> str:
    return (
        f"{count} replica(s) lost workers and could not be placed again within {wait_s:g}s "
        "(cluster.placement_timeout_s); add nodes or raise cluster.placement_timeout_s"
    )


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
