"""Spawning the worker group's actors: the actor class, the user's code shipped with them, the
driver's storage settings forwarded to them, and the bundle each one runs in."""

from __future__ import annotations

import ray

from rayhybrid.cluster import code
from rayhybrid.cluster.connect import inherited_env
from rayhybrid.cluster.drain import stop
from rayhybrid.cluster.placement import ReplicaShape
from rayhybrid.cluster.reservation import Reservation
from rayhybrid.cluster.standby import Standbys, adoptable
from rayhybrid.cluster.worker import CONTROL, TrainWorker
from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout
from rayhybrid.storage.store import forwarded_env


class Spawner:
    """Starts actors in the slots of a `Reservation`, one per rank of a replica (stage-major),
    each in the bundle of its pipeline stage."""

    def __init__(
        self, cfg: Config, shape: ReplicaShape, reservation: Reservation, actor_cls: type = TrainWorker
    ) -> None:
        self.shape = shape
        self.reservation = reservation
        # The actor class (a test may probe with another), answering pings while it trains;
        # its warm standbys (fault.standby) are of the same class.
        self.actor_cls = ray.remote(concurrency_groups={CONTROL: 1})(adoptable(actor_cls))
        self.standbys = Standbys(self.actor_cls, standby_count(cfg))
        # The driver's storage settings (AWS_*, GOOGLE_*, ...), for nodes started without them;
        # not those a local Ray's workers inherited already: an actor with no runtime
        # environment can take one of the worker processes Ray started ahead, instead of a new one.
        inherited = inherited_env()
        self.env = {k: v for k, v in forwarded_env().items() if inherited.get(k) != v}
        # The model's code for nodes without it (cluster.code), its sizes checked before
        # anything is placed; uploaded when actors start (rayhybrid/cluster/code.py).
        self.code = code.shipment(cfg)

    def actors(self, cfg: Config, slots: list[int], replicas) -> dict[int, tuple]:
        """The actors of `slots` (slot -> actors): those of `replicas` kept, new ones where a slot
        has none or lost some (None), made with `cfg`. If one cannot be started, the ones it
        started are stopped again."""
        size = Layout.of(cfg).topology.replica_size
        starting = any(actor is None for slot in slots for actor in replicas.get(slot, [None]))
        # The code is uploaded again if Ray dropped it meanwhile (no actor referred to it).
        runtime_env = code.runtime_env(self.code, self.env) if starting else None
        out, new = {}, []
        try:
            for slot in slots:
                actors = list(replicas.get(slot, (None,) * size))
                for missing in self._missing(actors):  # per pipeline stage (bundle)
                    taken = self.standbys.take_for(self.reservation, slot, missing)
                    for local in missing:
                        actors[local] = taken.get(local) or self._spawn(cfg, slot, local, runtime_env)
                        new.append(actors[local])
                out[slot] = tuple(actors)
        except BaseException:
            stop(new)
            raise
        return out

    def _missing(self, actors: list) -> list[list[int]]:
        """The positions without an actor in `actors` (a replica's), by pipeline stage."""
        tp = self.shape.tp
        stages = [
            [local for local in range(stage, stage + tp) if actors[local] is None]
            for stage in range(0, len(actors), tp)
        ]
        return [missing for missing in stages if missing]

    def tick(self, cfg: Config, infos) -> None:
        """At each training call: the warm standbys replaced where used or dead, in the
        background (`Standbys.tick`), on the nodes of the ranks (`infos`, their `WorkerInfo`)."""
        nodes = list(dict.fromkeys(info.node_id for info in infos))
        self.standbys.tick(nodes, lambda: (cfg, code.runtime_env(self.code, self.env)))

    def _spawn(self, cfg: Config, slot: int, local: int, runtime_env: dict | None):
        """An actor for position `local` (stage-major) of the replica in `slot`, in
        `runtime_env` (the shipped code, the forwarded settings)."""
        return self.actor_cls.options(
            runtime_env=runtime_env,
            num_cpus=self.shape.cpus_per_rank,
            num_gpus=1 if self.shape.use_gpu else 0,
            scheduling_strategy=self.reservation.strategy(slot, local),
            max_restarts=0,
        ).remote(cfg, 0, 1)


def standby_count(cfg: Config) -> int:
    """Warm standbys per node (`fault.standby`); none for a run that replaces no rank: one that
    restarts nothing (`fault.max_restarts=0`) and does not grow (elastic training off)."""
    if cfg.fault.max_restarts == 0 and not cfg.elastic.enabled:
        return 0
    return cfg.fault.standby
