"""The worker group's live state as one frozen value (as Ray Train v2's `WorkerGroupState`):
built when the group starts, resizes, recovers or joins again, and replaced whole, never edited.
`WorkerGroup` holds the current one and is the only code that replaces it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout


@dataclass(frozen=True)
class GroupState:
    """What the group trains with: its config (whose dp is the number of replicas in use), the
    slot of each data-parallel replica in use, in dp order (replica i is data-parallel rank i),
    each slot's actors (stage-major; None where one is to be started), and what the workers
    said when they last joined."""

    cfg: Config
    slots: tuple[int, ...] = ()
    replicas: Mapping[int, tuple] = field(default_factory=lambda: MappingProxyType({}))
    """slot -> its pp*tp actors; a slot moved or left out may keep an entry of Nones."""
    infos: tuple = ()
    """`WorkerInfo` of every rank, in rank order, from the last join."""
    descriptions: tuple[dict, ...] = ()
    """Every rank's `Trainer.describe()` from the last join."""
    store_host: Any = None
    """The worker serving the rendezvous of the last join (its rank 0), until the drain closes it."""
    generation: int = 0
    """The run's generation its workers join under (storage/generation.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, MappingProxyType):
            object.__setattr__(self, "replicas", MappingProxyType(dict(self.replicas)))

    def but(self, **changes) -> GroupState:
        """A copy with `changes` (the group's next state)."""
        return dataclasses.replace(self, **changes)

    @property
    def layout(self) -> Layout:
        return Layout.of(self.cfg)

    @property
    def dp(self) -> int:
        return self.cfg.topology.dp

    @property
    def workers(self) -> list:
        """The actors in use, in rank order."""
        return [actor for slot in self.slots for actor in self.replicas[slot]]

    def actors(self) -> list:
        """Every actor the state holds, in use or not (what a shutdown stops)."""
        return [actor for actors in self.replicas.values() for actor in actors if actor is not None]

    def placement(self) -> list[dict]:
        """Rank -> node and bundle (a pipeline stage's), for logs, tests and the plan."""
        out = []
        for info in self.infos:
            c = self.layout.topology.coord(info.rank)
            node = {"node_id": info.node_id, "ip": info.ip, "bundle": c.pp, "gpu_ids": list(info.gpu_ids)}
            out.append({"rank": info.rank, "dp": c.dp, "pp": c.pp, "tp": c.tp, **node})
        return out
