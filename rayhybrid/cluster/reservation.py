"""The worker group's reservation: one replica placement group per slot, the data-parallel
replicas the run may use (`placement.create_replicas`). Unused slots stay reserved: while
pending they show an autoscaler the demand, once placed they let the run grow."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayhybrid.cluster.placement import ReplicaShape, create_replicas, placement_state, release
from rayhybrid.errors import PlacementTimeout

# At start, once the replicas needed are placed, how long the others may take to join in.
START_GRACE_S = 2.0


class Reservation:
    """The placement group of every slot, in slot order; the only code that creates, moves and
    releases them. A slot keeps its number when its group is moved to other nodes."""

    def __init__(self, shape: ReplicaShape, num_slots: int) -> None:
        self.shape = shape
        self.num_slots = num_slots
        self._groups: list = []
        self._moves = 0  # replicas moved off draining nodes: each move's group gets a fresh name

    @property
    def groups(self) -> tuple:
        """The placement group of each slot (empty before `reserve` and after `release`)."""
        return tuple(self._groups)

    def reserve(self, needed: int, timeout_s: float) -> list[int]:
        """Ask for a placement group per slot and wait (at most `timeout_s`) until `needed` of
        them are placed; returns the placed slots. Raises `PlacementTimeout` when too few are
        placed in time (the groups stay reserved: the caller releases them)."""
        self._groups = create_replicas(self.shape, self.num_slots)
        refs = [pg.ready() for pg in self._groups]
        ready, rest = ray.wait(refs, num_returns=needed, timeout=timeout_s)
        if len(ready) < needed:
            raise PlacementTimeout(
                f"only {len(ready)} of {needed} replicas could be placed within {timeout_s:g}s "
                "(cluster.placement_timeout_s; the cluster is busy or short of resources); "
                "free resources or raise cluster.placement_timeout_s"
            )
        # The rest may be a moment behind (placed together); give them that moment, not more.
        ray.wait(rest, num_returns=len(rest), timeout=min(START_GRACE_S, timeout_s))
        return self.placed()

    def placed(self) -> list[int]:
        """Slots whose placement group is placed now (not pending, not being placed again)."""
        return [slot for slot, pg in enumerate(self._groups) if placement_state(pg) == "CREATED"]

    def nodes_of(self, slots: list[int]) -> list[str]:
        """The nodes that the placement groups of `slots` are placed on."""
        nodes = []
        for slot in slots:
            table = ray.util.placement_group_table(self._groups[slot])
            nodes += [n for n in table.get("bundles_to_node_id", {}).values() if n and n not in nodes]
        return nodes

    def node_of(self, slot: int, local: int) -> str | None:
        """The node of the bundle of position `local` (stage-major) of the replica in `slot`."""
        table = ray.util.placement_group_table(self._groups[slot])
        return table.get("bundles_to_node_id", {}).get(local // self.shape.tp)

    def wait_placed(self, slots, timeout_s: float) -> set[int]:
        """Wait until the placement groups of `slots` are placed (again: Ray places the bundles
        of a dead node elsewhere when the cluster has room); returns the slots still not placed
        after `timeout_s`."""
        refs = {slot: self._groups[slot].ready() for slot in slots}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        return {slot for slot, ref in refs.items() if ref not in ready}

    def move(self, slot: int) -> None:
        """Give `slot` a new placement group, pending until the cluster has room elsewhere (Ray
        places nothing new on a draining node)."""
        release([self._groups[slot]])
        self._moves += 1  # a fresh name: the group released may keep its own a moment
        self._groups[slot] = create_replicas(self.shape, 1, name=f"rayhybrid-move{self._moves}", first=slot)[0]

    def strategy(self, slot: int, local: int) -> PlacementGroupSchedulingStrategy:
        """Where the actor at position `local` (stage-major) of the replica in `slot` runs: the
        bundle of its pipeline stage."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self._groups[slot], placement_group_bundle_index=local // self.shape.tp
        )

    def release(self) -> None:
        """Release every placement group; safe when none was reserved."""
        release(self._groups)
        self._groups = []
