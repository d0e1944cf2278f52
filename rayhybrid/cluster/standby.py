"""Warm standby workers (`fault.standby`): worker processes started ahead of need, on the nodes
the ranks run on, with torch, rayhybrid and the model's code imported, that take a lost rank's
place (a recovery) or a new replica's (elastic growth) at no process start.

    standbys = Standbys(actor_cls, per_node=1)   # actor_cls: `ray.remote(adoptable(TrainWorker))`
    taken = standbys.take_for(reservation, slot, missing)  # position -> a warm one on its node
    standbys.tick(nodes, context)                # each training call: ping, replace, leave nodes
    standbys.stop()                              # at shutdown

Ray's own pool of prestarted worker processes does not give this: it holds plain Python
processes (no torch), keeps about one per CPU, kills idle ones past that soft limit (and an idle
one with a large memory footprint first, under memory pressure), and an actor that asks for a
runtime environment other than the job's, or a placement-group bundle, gets whichever process
the raylet finds or starts. A `worker_process_setup_hook` that imports torch is a job-wide
setting (`ray.init(runtime_env=...)`), which a run that joins a Ray it did not start cannot
set, and it would make every process of the job (tasks included) pay the imports. So the pool
is rayhybrid's own: plain actors of the rank's class, made with the rank's runtime environment.

Ray's resource accounting: a standby asks for no CPU and no GPU (`num_cpus=0, num_gpus=0`), so
it takes nothing from the cluster's books while idle, and is pinned to its node
(`NodeAffinitySchedulingStrategy`, not soft). Its warm-up (imports, `first_use`) runs on the
node's CPU outside any reservation, once per standby started. It runs a rank only in the place
of an actor of that rank's placement-group bundle that is gone: the bundle still reserves that
actor's CPUs and GPU, which nothing but rayhybrid's actors can be placed in. On GPUs the standby
holds the GPU it uses in Ray's books for as long as it runs the rank: in `adopt` it starts a
lease, an actor of its own asking for that many GPUs in the bundle (`GpuLease`, `num_cpus=0`),
and takes the lease's GPU ids as its own (`worker.ADOPTED_GPUS`; `_join` sets
CUDA_VISIBLE_DEVICES before CUDA starts). An actor's own actors die with it, so the lease ends
with the rank, and no later actor of the bundle is given that GPU meanwhile.

A standby is pinged at each training call (at most once per call, in its own thread); one whose
ping has been out longer than PING_TIMEOUT_S is stopped or wedged and counts as dead, and only
standbys that answered are taken over (`take` pings them first). Default 1 per node: a standby
reserves no CPU or GPU, so what a node allows is bounded by its memory (0.40 GB resident on
CPU, 0.26 GB of it its own), and one covers one loss per node between refills. Its cost after
each use: one process start's CPU, paid in the background once the run has trained a step
again (`tick`)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.cluster.calls import PING_TIMEOUT_S
from rayhybrid.cluster.worker import ADOPTED_GPUS, CONTROL

log = logging.getLogger("rayhybrid.cluster.group")

GPU_LEASE_TIMEOUT_S = 10.0
"""How long a standby's GPU lease may take to be placed before a new actor is started instead."""
MAX_FAILED_STARTS = 3
"""Standbys in a row that die on one node before they are ready (a broken environment there)
turn that node's standbys off."""
NAME_PREFIX = "rayhybrid-standby"
"""Standbys are named actors (`<prefix>-<pool>-<n>`): a test or an operator finds them by name."""


class GpuLease:
    """Holds GPUs of a placement-group bundle in Ray's books for the standby that made it (and
    dies with it); `gpus`: their ids."""

    def gpus(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]


def adoptable(cls: type) -> type:
    """`cls` (the rank's actor class) with `warm` and `adopt`, the two calls a standby answers
    that a rank does not need."""

    class Standby(cls):
        def warm(self) -> int:
            """Import what a rank imports before its first join, the trainer (`warm_up`) and the
            model's module (`get_spec`), and pay torch's first use (`first_use`); returns the
            process id."""
            from rayhybrid.models.registry import get_spec

            self.warm_up()
            get_spec(self.cfg.model)
            first_use()
            return os.getpid()

        @ray.method(concurrency_group=CONTROL)
        def adopt(self, strategy, count: int) -> tuple[str, ...]:
            """Take the place of a rank of the bundle of `strategy`: hold `count` of its GPUs for
            as long as this process lives (a `GpuLease` it owns) and report them as its own from
            now on (`own_gpus`); returns their ids. In the control thread: it does not wait
            for a warm-up still running."""
            lease = (
                ray.remote(GpuLease)
                .options(num_cpus=0, num_gpus=count, scheduling_strategy=strategy, max_restarts=0)
                .remote()
            )
            try:
                gpus = tuple(ray.get(lease.gpus.remote(), timeout=GPU_LEASE_TIMEOUT_S))
            except BaseException:
                ray.kill(lease, no_restart=True)
                raise
            self._gpu_lease = lease  # kept: the lease lives while this process does
            os.environ[ADOPTED_GPUS] = ",".join(gpus)
            return gpus

    # Named as the rank's class in Ray's listings; its qualified name stays a local one, so that
    # cloudpickle ships the class itself (one found by name would be shipped as that name).
    Standby.__name__ = cls.__name__
    return Standby


def first_use() -> None:
    """What torch does once per process on its first step, done ahead on the CPU (no CUDA: a
    standby holds no GPU): a tiny layer's forward, backward and AdamW step. Measured in a
    dp2_pp2_tp2 recovery on 2 cores: the standby's model build fell from 0.39 s to 0.03 s and
    the recovery's init from 0.76 s to 0.44 s."""
    import torch

    layer = torch.nn.Linear(8, 8)
    layer(torch.randn(2, 8)).sum().backward()
    torch.optim.AdamW(layer.parameters()).step()


@dataclass
class _Standby:
    actor: object
    name: str
    node: str
    warm: object
    """Its warm-up call: its answer (the pid) says it is ready; its error, dead."""
    pid: int | None = None
    ping: object = None
    """The ping out (None: the last one answered), sent at `asked_at`."""
    asked_at: float = 0.0


class Standbys:
    """`per_node` standbys on each node of the group's ranks (0: none). `take` hands one over;
    `tick` starts the ones missing, after the run has trained a step since the last `take`."""

    def __init__(self, actor_cls, per_node: int) -> None:
        self.actor_cls = actor_cls
        self.per_node = per_node
        self.pool: dict[str, list[_Standby]] = defaultdict(list)
        self._names = (f"{NAME_PREFIX}-{uuid.uuid4().hex[:8]}-{n}" for n in itertools.count())
        self._calm = 0  # training calls since the last take: standbys start from the second on
        self._due = True  # some may be missing: fill the pool at the next chance
        self._failed_starts: dict[str, int] = defaultdict(int)  # per node, in a row, before ready
        self.off_nodes: set[str] = set()  # nodes whose standbys kept dying before they were ready

    def take_for(self, reservation, slot: int, missing: list[int]) -> dict[int, object]:
        """Standbys for the positions `missing` (stage-major, one pipeline stage's) of the
        replica in `slot` of `reservation`: position -> actor, on the node of that stage's
        bundle. On GPUs all of them or none (each leases one GPU of the bundle: `adopt`); on
        CPUs as many as there are. Nothing is looked up while the pool is empty."""
        if not any(self.pool.values()):
            return {}
        use_gpu = reservation.shape.use_gpu
        node = reservation.node_of(slot, missing[0])
        taken = self.take(node, len(missing), every=use_gpu)
        if not use_gpu or not taken:
            return dict(zip(missing, taken, strict=False))
        strategy = reservation.strategy(slot, missing[0])
        adopted = [actor.adopt.remote(strategy, 1) for actor in taken]
        try:
            ray.get(adopted, timeout=GPU_LEASE_TIMEOUT_S + PING_TIMEOUT_S)
        except (GetTimeoutError, RayError) as err:
            log.warning("warm standbys could not lease their GPUs (%s); starting new actors", type(err).__name__)
            for actor in taken:
                _kill(actor)  # their leases die with them
            return {}
        return dict(zip(missing, taken, strict=True))

    def take(self, node_id: str | None, count: int = 1, every: bool = False) -> list:
        """Up to `count` standbys on `node_id` (`every`: exactly `count` or none) that answer a
        ping now, ready ones first; those dead or whose ping is out longer than PING_TIMEOUT_S
        are killed and dropped. The ones taken are the caller's from now on (stopping them
        too); the pool starts others after the run has trained again (`tick`)."""
        standbys = list(self.pool.get(node_id, []))
        for standby in [s for s in standbys if self._check(s)]:
            self._ask(standby)  # a fresh ping, unless one is out already
        alive = sorted(self._answers(standbys, count), key=lambda s: s.pid is None)
        for standby in [s for s in standbys if not self._check(s)]:
            self.pool[node_id].remove(standby)
            _kill(standby.actor)
            log.warning("warm standby %s (pid %s) did not answer; not taken", standby.name, standby.pid or "warming")
        if not alive or (every and len(alive) < count):
            return []
        taken = alive[:count]
        for standby in taken:
            self.pool[node_id].remove(standby)
            log.info("a rank taken over by warm standby %s (pid %s)", standby.name, standby.pid or "warming")
        self._calm, self._due = 0, True
        return [standby.actor for standby in taken]

    def _answers(self, standbys: list[_Standby], count: int) -> list[_Standby]:
        """Of `standbys` (each with a ping out), those that answer: waits until `count` have,
        or until every ping left is out PING_TIMEOUT_S (a stopped one's: it is then dropped)."""
        while True:
            alive = [s for s in standbys if self._check(s)]  # collects the answers
            answered = [s for s in alive if s.ping is None]
            out = [s for s in alive if s.ping is not None]
            if len(answered) >= count or not out:
                return answered
            left = PING_TIMEOUT_S - (time.monotonic() - max(s.asked_at for s in out))
            if left <= 0:
                return answered
            ray.wait([s.ping for s in out], num_returns=1, timeout=left)

    def tick(self, nodes: list[str], context) -> None:
        """Called at each training call, after its calls are out: standbys found dead (or whose
        ping is out too long) are dropped, the others pinged; those on nodes that no longer run
        ranks (`nodes`: those that do) are stopped; when some are missing (at the start, after a
        `take`, after a death), from the second call on after the last take (a recovery's first
        step does not share the CPU with a new process's imports), each node is filled up to
        `per_node`, in the background. `context()`: the config and the runtime environment to
        start them with. An error here turns the standbys off (one warning): it never stops
        the run."""
        if self.per_node <= 0:
            return
        try:
            self._tick(nodes, context)
        except Exception as err:  # noqa: BLE001 - the pool is a help: the run goes on without it
            log.warning("warm standbys turned off after an error in their upkeep: %s: %s", type(err).__name__, err)
            self.stop()
            self.per_node = 0

    def _tick(self, nodes: list[str], context) -> None:
        self._calm += 1
        for node in [n for n in self.pool if n not in nodes]:
            for standby in self.pool.pop(node):
                _kill(standby.actor)  # the run left that node (an evacuation, a shrink)
        for node, standbys in self.pool.items():
            for standby in list(standbys):
                if self._check(standby):
                    self._ask(standby)
                    continue
                standbys.remove(standby)
                _kill(standby.actor)  # dead, stopped, or alive with its warm-up failed
                self._due = True
                self._failed_starts[node] = 0 if standby.pid else self._failed_starts[node] + 1
                log.warning("warm standby %s (pid %s) died; starting another", standby.name, standby.pid or "warming")
                if self._failed_starts[node] >= MAX_FAILED_STARTS:
                    log.warning(
                        "%d warm standbys in a row died before they were ready on node %s; no more there",
                        MAX_FAILED_STARTS,
                        node[:8],
                    )
                    self.off_nodes.add(node)
        if self._calm < 2 or not self._due:
            return
        self._due = False
        cfg, runtime_env = context()
        for node in [n for n in nodes if n not in self.off_nodes]:
            for _ in range(self.per_node - len(self.pool[node])):
                self.pool[node].append(self._start(cfg, runtime_env, node))

    def _start(self, cfg, runtime_env: dict | None, node: str) -> _Standby:
        name = next(self._names)
        actor = self.actor_cls.options(
            name=name,
            runtime_env=runtime_env,
            num_cpus=0,
            num_gpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            max_restarts=0,
        ).remote(cfg, 0, 1)
        return _Standby(actor, name, node, actor.warm.remote())

    def _check(self, standby: _Standby) -> bool:
        """False when it is dead: its warm-up or a ping failed, or (ready) its ping has been out
        longer than PING_TIMEOUT_S (stopped, wedged). Never blocks."""
        if standby.pid is None and _done(standby.warm):
            try:
                standby.pid = ray.get(standby.warm)
            except RayError:
                return False
            log.info("warm standby %s ready on node %s (pid %d)", standby.name, standby.node[:8], standby.pid)
        if standby.ping is None:
            return True
        if _done(standby.ping):
            try:
                ray.get(standby.ping)
            except RayError:
                return False
            standby.ping = None
            return True
        return standby.pid is None or time.monotonic() - standby.asked_at <= PING_TIMEOUT_S

    def _ask(self, standby: _Standby) -> None:
        """Ping it, unless a ping is out already."""
        if standby.ping is None:
            standby.ping, standby.asked_at = standby.actor.ping.remote(), time.monotonic()

    def stop(self) -> None:
        """Kill every standby (at shutdown)."""
        for standby in itertools.chain.from_iterable(self.pool.values()):
            _kill(standby.actor)
        self.pool.clear()


def _done(ref) -> bool:
    return bool(ray.wait([ref], timeout=0)[0])


def _kill(actor) -> None:
    with contextlib.suppress(RayError):
        ray.kill(actor, no_restart=True)
