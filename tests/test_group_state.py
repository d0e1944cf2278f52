"""The worker group's live state (`rayhybrid/cluster/state.py`) is one frozen value: the
group builds the next one and replaces it, and a state it handed out never changes under the
reader. No Ray: actors are stand-ins."""

from __future__ import annotations

import dataclasses
import types

import pytest

from rayhybrid.cluster.state import GroupState
from rayhybrid.config.schema import with_dp
from rayhybrid.preflight import load_config


def _state() -> GroupState:
    cfg = with_dp(load_config(["topology.pp=2", "topology.tp=2", "topology.dp=1"]), 2)
    replicas = {3: ("a0", "a1", "a2", "a3"), 1: ("b0", "b1", "b2", "b3"), 0: (None,) * 4}
    infos = tuple(types.SimpleNamespace(rank=r, node_id=f"n{r // 4}", ip="10.0.0.1", gpu_ids=()) for r in range(8))
    return GroupState(cfg, slots=(3, 1), replicas=replicas, infos=infos)


def test_workers_are_in_rank_order_replica_by_replica():
    state = _state()
    assert state.dp == 2 and state.layout.world_size == 8
    # Replica i is the slot at place i (dp order), its actors stage-major: a worker's place is its rank.
    assert state.workers == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    # A shutdown stops every actor the state holds, in use or not; None is no actor.
    assert sorted(state.actors()) == sorted(state.workers)


def test_the_state_is_replaced_never_edited():
    state = _state()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.slots = (1,)  # type: ignore[misc]
    with pytest.raises(TypeError):
        state.replicas[1] = (None,) * 4  # type: ignore[index]
    source = {1: ("b0", "b1", "b2", "b3")}
    shrunk = state.but(cfg=with_dp(state.cfg, 1), slots=(1,), replicas=source)
    source[1] = ("x",) * 4  # the caller's dict is copied, not kept
    assert shrunk.workers == ["b0", "b1", "b2", "b3"] and shrunk.dp == 1
    assert state.workers[:4] == ["a0", "a1", "a2", "a3"] and state.dp == 2  # the one before is as it was


def test_placement_names_each_rank_coordinates_and_bundle():
    rows = _state().placement()
    assert [r["rank"] for r in rows] == list(range(8))
    assert rows[5] == {
        "rank": 5,
        "dp": 1,
        "pp": 0,
        "tp": 1,
        "node_id": "n1",
        "ip": "10.0.0.1",
        "bundle": 0,
        "gpu_ids": [],
    }
