"""Warm standby workers (`fault.standby`): worker processes started ahead of need, on the nodes
the ranks run on, with torch, rayhybrid and the model's code imported, that take a lost rank's
place (a recovery) or a new replica's (elastic growth) at no process start.

    standbys = Standbys(actor_cls, per_node=1)   # actor_cls: `ray.remote(adoptable(TrainWorker))`
    taken = standbys.take_for(reservation, slot, missing)  # position -> a warm one on its node
    standbys.tick(context)                       # each training call: replace used or dead ones
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
(`NodeAffinitySchedulingStrategy`, not soft). It runs a rank only in the place of an actor of
that rank's placement-group bundle that is gone: the bundle still reserves that actor's CPUs
and GPU, which nothing but rayhybrid's actors can be placed in, so the standby computes on
resources Ray keeps for it. Its GPU ids are the ones Ray frees in that bundle: a task asking
for that many GPUs in the bundle (`num_cpus=0`) reads them (`bundle_gpus`), and the standby sees
them from its next join on (`adopt`, `worker.ADOPTED_GPUS`; `_join` sets CUDA_VISIBLE_DEVICES
before CUDA starts). A standby's cost: the memory of an idle process with torch imported (0.40 GB
resident on CPU, 0.26 GB of it its own), and one process start's CPU after each use, paid in the
background once the run has trained a step again (`tick`)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayhybrid.cluster.worker import ADOPTED_GPUS

log = logging.getLogger("rayhybrid.cluster.group")

PROBE_EVERY_S = 2.0
"""How often a standby is asked whether it is still alive (a ping it answers in its own thread)."""
GPU_PROBE_TIMEOUT_S = 10.0
"""How long the GPU ids of a bundle may take to read before a new actor is started there instead."""
MAX_FAILED_STARTS = 3
"""Standbys in a row that die before they are ready (a broken environment) turn the pool off."""
NAME_PREFIX = "rayhybrid-standby"
"""Standbys are named actors (`<prefix>-<pool>-<n>`): a test or an operator finds them by name."""


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

        def adopt(self, gpu_ids: tuple[str, ...]) -> None:
            """Take the place of a rank whose GPUs (Ray's ids, freed in its bundle) are `gpu_ids`:
            this process reports them as its own from now on (`own_gpus`)."""
            os.environ[ADOPTED_GPUS] = ",".join(gpu_ids)

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


@ray.remote(num_cpus=0, max_retries=0)
def _bundle_gpus() -> list[str]:
    return [str(g) for g in ray.get_gpu_ids()]


def bundle_gpus(strategy, count: int) -> list[str] | None:
    """The ids of the `count` GPUs free in the placement-group bundle of `strategy` (those of
    the actors gone from it), as Ray assigns them; None when they cannot be read in time."""
    ref = _bundle_gpus.options(num_gpus=count, scheduling_strategy=strategy).remote()
    try:
        return ray.get(ref, timeout=GPU_PROBE_TIMEOUT_S)
    except (GetTimeoutError, RayError):
        ray.cancel(ref, force=True)
        return None


@dataclass
class _Standby:
    actor: object
    name: str
    node: str
    probe: object
    """The last call asked of it (`warm`, then pings): its answer says it is alive; its error, dead."""
    pid: int | None = None
    asked_at: float = field(default_factory=time.monotonic)


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
        self._failed_starts = 0  # standbys in a row that died before they were warm

    def take_for(self, reservation, slot: int, missing: list[int]) -> dict[int, object]:
        """Standbys for the positions `missing` (stage-major, one pipeline stage's) of the
        replica in `slot` of `reservation`: position -> actor, on the node of that stage's
        bundle. On GPUs all of them or none (each adopts one of the GPUs Ray frees in the
        bundle, and a new actor started beside them could be given one of those); on CPUs as
        many as there are."""
        use_gpu = reservation.shape.use_gpu
        node = reservation.node_of(slot, missing[0])
        taken = self.take(node, len(missing), every=use_gpu)
        if not use_gpu or not taken:
            return dict(zip(missing, taken, strict=False))
        gpus = bundle_gpus(reservation.strategy(slot, missing[0]), len(taken))
        if gpus is None or len(gpus) != len(taken):
            for actor in taken:
                _kill(actor)
            return {}
        for actor, gpu in zip(taken, gpus, strict=True):
            actor.adopt.remote((gpu,))  # before the join's calls: an actor runs its calls in order
        return dict(zip(missing, taken, strict=True))

    def take(self, node_id: str | None, count: int = 1, every: bool = False) -> list:
        """Up to `count` standbys on `node_id` (`every`: exactly `count` or none), warm ones first;
        those known dead are dropped. The ones taken are the caller's from now on (stopping
        them too); the pool starts others after the run has trained again (`tick`)."""
        alive = []
        for standby in sorted(self.pool.get(node_id, []), key=lambda s: s.pid is None):
            if self._alive(standby) is False:
                self.pool[node_id].remove(standby)
                _kill(standby.actor)
            else:
                alive.append(standby)
        if not alive or (every and len(alive) < count):
            return []
        taken = alive[:count]
        for standby in taken:
            self.pool[node_id].remove(standby)
            log.info("a rank taken over by warm standby %s (pid %s)", standby.name, standby.pid or "warming")
        self._calm, self._due = 0, True
        return [standby.actor for standby in taken]

    def tick(self, context) -> None:
        """Called at each training call: standbys found dead are dropped; when some are missing
        (at the start, after a `take`, after a death), from the second call on after the last
        take (a recovery's first step does not share the CPU with a new process's imports),
        each node is filled up to `per_node`, in the background. `context()`: the config, the
        runtime environment and the nodes (those of the ranks) to start them with."""
        if self.per_node <= 0:
            return
        self._calm += 1
        for standbys in self.pool.values():
            for standby in [s for s in standbys if self._alive(s) is False]:
                standbys.remove(standby)
                _kill(standby.actor)  # dead, or alive with its warm-up failed
                self._due = True
                self._failed_starts = 0 if standby.pid else self._failed_starts + 1
                log.warning("warm standby %s (pid %s) died; starting another", standby.name, standby.pid or "warming")
        if self._failed_starts >= MAX_FAILED_STARTS:
            log.warning("%d warm standbys in a row died before they were ready; fault.standby off", MAX_FAILED_STARTS)
            self.stop()
            self.per_node = 0
            return
        if self._calm < 2 or not self._due:
            return
        self._due = False
        cfg, runtime_env, nodes = context()
        for node in nodes:
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

    def _alive(self, standby: _Standby) -> bool | None:
        """True when its last call answered, False when it failed (dead), None while it is out;
        asks again every PROBE_EVERY_S. Never blocks."""
        done, _ = ray.wait([standby.probe], timeout=0)
        if not done:
            return None
        try:
            pid = ray.get(standby.probe)
        except RayError:
            return False
        if standby.pid is None:
            standby.pid = pid
            log.info("warm standby %s ready on node %s (pid %d)", standby.name, standby.node[:8], pid)
        if time.monotonic() - standby.asked_at > PROBE_EVERY_S:
            standby.probe, standby.asked_at = standby.actor.ping.remote(), time.monotonic()
        return True

    def stop(self) -> None:
        """Kill every standby (at shutdown)."""
        for standby in itertools.chain.from_iterable(self.pool.values()):
            _kill(standby.actor)
        self.pool.clear()


def _kill(actor) -> None:
    with contextlib.suppress(RayError):
        ray.kill(actor, no_restart=True)
