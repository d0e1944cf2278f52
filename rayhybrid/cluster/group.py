"""A worker group: the replica placement groups and one actor per rank, in rank order."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayError

from rayhybrid.cluster.calls import Calls
from rayhybrid.cluster.drain import Drained, drain, pinger, stop
from rayhybrid.cluster.merge import merge_steps
from rayhybrid.cluster.placement import ReplicaShape
from rayhybrid.cluster.reservation import Reservation
from rayhybrid.cluster.spawn import Spawner
from rayhybrid.cluster.state import GroupState
from rayhybrid.cluster.worker import TrainWorker
from rayhybrid.config.schema import Config, with_dp
from rayhybrid.config.topology import Layout
from rayhybrid.errors import PlacementTimeout
from rayhybrid.faults import Injection

if TYPE_CHECKING:
    from rayhybrid.cluster.worker import WorkerInfo
    from rayhybrid.trainer.results import HealResult, HeldState, RestoreResult, SaveResult, StepResult

log = logging.getLogger(__name__)


class WorkerGroup:
    """`num_slots` replica placement groups (its `reservation`, one per data-parallel replica the
    run may use; `num_slots == dp` for a fixed size) and the actors of the replicas in use, in
    rank order (docs/design.md, invariant 1). Its live state is one frozen `GroupState`, replaced
    whole by its methods; its `remote_calls` track the calls in flight. Start, resize and
    recovery are made of the same pieces:

        placed = group.reserve(needed)        # placement groups for every slot
        group.rebuild(slots)                  # actors for exactly these slots, joined in order
        drained = group.drain()               # after a failed call: what is dead, which slots
        lost = group.wait_placed(drained.broken, timeout_s)   # slots not placed again in time
    """

    def __init__(
        self, cfg: Config, shape: ReplicaShape, num_slots: int | None = None, actor_cls: type = TrainWorker
    ) -> None:
        self.shape = shape
        self.reservation = Reservation(shape, num_slots or cfg.topology.dp)
        self.spawner = Spawner(cfg, shape, self.reservation, actor_cls)  # `actor_cls`: a test may probe
        self.remote_calls = Calls()
        self._state = GroupState(cfg)

    @property
    def state(self) -> GroupState:
        """The group's live state, a frozen value (read it; the group replaces it)."""
        return self._state

    @property
    def cfg(self) -> Config:
        return self._state.cfg

    @property
    def dp(self) -> int:
        return self._state.dp

    @property
    def slots(self) -> tuple[int, ...]:
        """The slot of each data-parallel replica in use, in dp order."""
        return self._state.slots

    @property
    def replicas(self) -> Mapping[int, tuple]:
        """slot -> its actors (stage-major; None where one is to be started), read-only."""
        return self._state.replicas

    @property
    def layout(self) -> Layout:
        return self._state.layout

    @property
    def workers(self) -> list:
        """The actors in use, in rank order."""
        return self._state.workers

    @property
    def infos(self) -> tuple[WorkerInfo, ...]:
        return self._state.infos

    @property
    def descriptions(self) -> tuple[dict, ...]:
        return self._state.descriptions

    @property
    def env(self) -> dict[str, str]:
        """The driver's storage settings that the workers get (`forwarded_env`)."""
        return self.spawner.env

    @property
    def start_timeout_s(self) -> float:
        """Starting a process, building a model or loading a checkpoint can take longer than a
        step: bounded by whichever of the step and placement timeouts is longer."""
        return max(self.cfg.fault.step_timeout_s, self.cfg.cluster.placement_timeout_s)

    def start(self) -> None:
        """A fixed-size group: reserve every slot, wait until all are placed, start on them."""
        self.rebuild(self.reserve(self.reservation.num_slots))

    def reserve(self, needed: int) -> list[int]:
        """Ask for a placement group per slot and wait (at most `cluster.placement_timeout_s`)
        until `needed` of them are placed; returns the placed slots. Releases them all and
        raises `PlacementTimeout` when too few are placed in time."""
        try:
            return self.reservation.reserve(needed, self.cfg.cluster.placement_timeout_s)
        except PlacementTimeout:
            self.shutdown()
            raise

    def nodes_of(self, slots: list[int]) -> list[str]:
        """The nodes that the placement groups of `slots` are placed on."""
        return self.reservation.nodes_of(slots)

    def placed_slots(self) -> list[int]:
        """Slots whose placement group is placed now (not pending, not being placed again)."""
        return self.reservation.placed()

    def wait_placed(self, slots, timeout_s: float) -> set[int]:
        """Wait until the placement groups of `slots` are placed again; returns the slots still
        not placed after `timeout_s` (`Reservation.wait_placed`)."""
        return self.reservation.wait_placed(slots, timeout_s)

    def replace(self, slots: list[int]) -> None:
        """Move the replicas of `slots` off their nodes (a node being drained): stop their actors
        and give the slots new placement groups, pending until the cluster has room elsewhere
        (Ray places nothing new on a draining node). `rebuild` starts actors in them."""
        replicas = dict(self._state.replicas)
        for slot in slots:
            stop(replicas.get(slot, []))
            replicas[slot] = (None,) * self.layout.topology.replica_size
            self.reservation.move(slot)
        self._state = self._state.but(replicas=replicas)

    def rebuild(self, slots: list[int], generation: int | None = None) -> None:
        """Train on the replicas in `slots` (in this order: replica i is data-parallel rank i):
        stop the actors of slots left out, start actors where a slot has none or lost some,
        and join them all in a new process group (ranks and dp may change; a checkpoint
        restores the state), under the run's `generation`. Every call is bounded in time (`_join`)."""
        state = self._state
        for slot in [s for s in state.slots if s not in slots]:
            stop(state.replicas[slot])
        kept = {slot: actors for slot, actors in state.replicas.items() if slot in slots or slot not in state.slots}
        replicas = {**kept, **self.spawner.actors(state.cfg, slots, kept)}
        self._state = state.but(cfg=with_dp(state.cfg, len(slots)), slots=tuple(slots), replicas=replicas)
        self._state = self._state.but(generation=state.generation if generation is None else generation)
        self._join()

    def drain(self) -> Drained:
        """After a failed call: what is dead, which slots are broken, which nodes are lost
        (rayhybrid/cluster/drain.py); the actors gone are to be started again."""
        drained, self._state = drain(self._state, self.remote_calls)
        return drained

    def recover(self) -> list[int]:
        """Drain and rebuild on the same slots (a fixed-size group, as a tuning host keeps) under the
        same generation (tune's trials save no checkpoint: nothing to fence); returns the ranks replaced."""
        drained = self.drain()
        lost = self.wait_placed(drained.broken, self.cfg.cluster.placement_timeout_s)
        if lost:
            raise PlacementTimeout(not_placed_again(len(lost), self.cfg.cluster.placement_timeout_s))
        self.rebuild(list(self.slots))
        return sorted(drained.dead)

    def _join(self) -> None:
        """Every worker takes its rank, joins a new process group (a fresh port) and builds its
        part of the model. The state is replaced at each answer, so a drain after a join that
        failed knows the workers' nodes and the rendezvous to close."""
        workers, timeout, get = self.workers, self.start_timeout_s, self.remote_calls.get
        self._state = self._state.but(infos=tuple(get([w.info.remote() for w in workers], timeout, "start")))
        # Rank 0 serves the rendezvous; the drain closes it when a rank is lost during the join.
        master_port = get([workers[0].host_store.remote(len(workers))], timeout, "start")[0]
        self._state = self._state.but(store_host=workers[0])
        master_addr = self.infos[0].ip
        log.debug("%d workers joining a process group at %s:%d", len(workers), master_addr, master_port)
        gpus, gen = visible_gpus(self.infos), self._state.generation
        calls = [
            w.setup.remote(master_addr, master_port, gpus[rank], rank=rank, cfg=self.cfg, generation=gen)
            for rank, w in enumerate(workers)
        ]
        self._state = self._state.but(descriptions=tuple(get(calls, timeout, "setup")))
        infos = get([w.info.remote() for w in workers], timeout, "start")  # with their new ranks
        self._state = self._state.but(infos=tuple(infos))

    def reconfigure(self, cfg: Config) -> None:
        """Join every worker again under `cfg` (same topology; other settings may change, e.g.
        the micro-batch size of a tuning trial); recovers the group first after a failed call."""
        t, now = cfg.topology, self.cfg.topology
        if (t.dp, t.pp, t.tp) != (now.dp, now.pp, now.tp):
            raise ValueError("reconfigure keeps dp, pp and tp; use rebuild for another dp")
        self._state = self._state.but(cfg=cfg)
        if self.remote_calls.unsettled():
            self.recover()
        else:
            self._join()

    def errors(self) -> dict[int, str]:
        """After a failed call: the one-line error of each rank whose call failed (`Calls.errors`)."""
        return self.remote_calls.errors()

    def train(
        self, steps: int = 1, timeout_s: float | None = None, inject: Injection | None = None
    ) -> list[StepResult]:
        """Run `steps` optimizer steps on every rank; returns each step's result, merged.
        A call that makes no progress for `timeout_s` counts as a failed (hung) worker.
        `inject`: a `fault.inject` fault for one rank to trigger at the start of the call."""
        calls = self._on_every_rank("train", inject, steps)
        self.spawner.tick(self.cfg, self.infos)  # warm standbys kept, in the background, the step issued
        results = self.remote_calls.get(calls, timeout_s=timeout_s, what="step", probe=pinger(self.workers))
        return merge_steps(results, self.dp, self.layout.topology.replica_size)

    def save(self, root: str, keep: int, timeout_s: float | None = None, inject: Injection | None = None) -> SaveResult:
        """Start (async) or write (sync) a checkpoint; rank 0's record of it (trainer/checkpoint.py)."""
        calls = self._on_every_rank("save", inject, root, keep)
        return self.remote_calls.get(calls, timeout_s=timeout_s, what="checkpoint save")[0]

    def finished_saves(self, timeout_s: float | None = None) -> list[SaveResult]:
        """Wait for the checkpoint upload in flight, if any; rank 0's records of the saves that
        finished since the last report (committed, or failed with `error`)."""
        calls = [w.finished_saves.remote() for w in self.workers]
        return self.remote_calls.get(calls, timeout_s, "checkpoint upload")[0]

    def _on_every_rank(self, method: str, inject: Injection | None, *args) -> list:
        """`method(*args)` on every worker, the injected fault's rank told to trigger it."""
        return [
            getattr(w, method).remote(*args, inject=inject.kind if inject and inject.rank == rank else None)
            for rank, w in enumerate(self.workers)
        ]

    def load(self, path: str, meta: dict) -> RestoreResult:
        """Every rank restores the checkpoint at `path` (its `meta`, meta.json); rank 0's result."""
        calls = [w.load.remote(path, meta) for w in self.workers]
        return self.remote_calls.get(calls, self.start_timeout_s, "restore")[0]

    def held(self) -> list[HeldState | None]:
        """fault.heal: each rank's kept state, in rank order (`HeldState`: its step, its bytes,
        whether it kept that step's results), or None (`TrainWorker.held`)."""
        return self.remote_calls.get([w.held.remote() for w in self.workers], self.start_timeout_s, "heal")

    def heal(self, sources: dict[int, int]) -> list[HealResult]:
        """Every rank in `sources` (receiver -> sender, ranks of the new world) receives its state
        from its sender; every other rank takes the state it kept and sends it to the ranks that
        name it (rayhybrid/trainer/heal.py does the sending). Returns each rank's `HealResult`
        (the step it now holds, its record of that step, the bytes moved, the seconds)."""
        sends = defaultdict(list)
        for dst, src in sources.items():
            sends[src].append(dst)
        calls = [w.heal.remote(sources.get(rank), sorted(sends[rank])) for rank, w in enumerate(self.workers)]
        return self.remote_calls.get(calls, self.start_timeout_s, "heal")

    def trace(self, step: int, ranges: list[list[int]]) -> list[dict]:
        """data.trace: rank 0's rows of the samples in `ranges` of step `step` (`TrainWorker.trace`)."""
        return self.remote_calls.get([self.workers[0].trace.remote(step, ranges)], self.start_timeout_s, "heal")[0]

    def placement(self) -> list[dict]:
        """Rank -> node and bundle, for logs, tests and the plan (`GroupState.placement`)."""
        return self._state.placement()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every actor and release every placement group; safe on a half-built group."""
        workers = self._state.actors()
        if workers and graceful:
            try:
                ray.get([w.close.remote() for w in workers], timeout=30)
            except (RayError, TimeoutError):  # dead or hung workers: they are killed below
                pass
        stop(workers)
        self.spawner.standbys.stop()
        self.reservation.release()
        self.remote_calls.forget()
        self._state = GroupState(self.cfg)


def not_placed_again(count: int, wait_s: float) -> str:
    return (
        f"{count} replica(s) lost workers and could not be placed again within {wait_s:g}s "
        "(cluster.placement_timeout_s); add nodes or raise cluster.placement_timeout_s"
    )


def visible_gpus(infos) -> list[tuple[str, ...]]:
    """For each rank (`WorkerInfo`, in rank order), every GPU the ranks on its node hold, in
    order: each worker sees all of them (so NCCL can use peer-to-peer links)."""
    by_node: dict[str, list[str]] = defaultdict(list)
    for info in infos:
        by_node[info.node_id].extend(info.gpu_ids)
    return [tuple(sorted(set(by_node[info.node_id]), key=_gpu_key)) for info in infos]


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)
