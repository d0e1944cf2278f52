"""Pure topology math: rank <-> coordinates (docs/design.md, invariant 1), replicas, layer split,
stage placement, micro-batch count (invariant 3)."""

from __future__ import annotations

import itertools

import pytest

from rayhybrid.config.topology import Coord, Topology, groups_across_nodes, num_microbatches, split_layers, stage_ids

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (3, 2, 4), (4, 3, 1), (1, 4, 2)]


@pytest.mark.parametrize("dp,pp,tp", SHAPES)
def test_rank_order_formula_and_roundtrip(dp, pp, tp):
    topo = Topology(dp, pp, tp)
    assert topo.world_size == dp * pp * tp
    assert topo.replica_size == pp * tp
    seen = set()
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        rank = topo.rank(d, p, t)
        assert rank == (d * pp + p) * tp + t
        assert topo.coord(rank) == Coord(dp=d, pp=p, tp=t)
        seen.add(rank)
    assert seen == set(range(topo.world_size))
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        assert topo.rank(c.dp, c.pp, c.tp) == rank


def test_tp_fastest_dp_outermost():
    topo = Topology(2, 2, 2)
    assert [topo.coord(r) for r in range(8)] == [
        Coord(0, 0, 0), Coord(0, 0, 1), Coord(0, 1, 0), Coord(0, 1, 1),
        Coord(1, 0, 0), Coord(1, 0, 1), Coord(1, 1, 0), Coord(1, 1, 1),
    ]  # fmt: skip
    assert str(topo) == "dp2_pp2_tp2"
    assert str(Coord(1, 0, 1)) == "dp1|pp0|tp1"


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_coord_outside_world(rank):
    with pytest.raises(IndexError):
        Topology(2, 2, 2).coord(rank)


@pytest.mark.parametrize("dp,pp,tp", SHAPES)
def test_replica_ranks(dp, pp, tp):
    topo = Topology(dp, pp, tp)
    union = []
    for d in range(dp):
        ranks = topo.replica_ranks(d)
        # Stage by stage, tp fastest: one contiguous block of pp*tp ranks per replica.
        assert ranks == [(d * pp + p) * tp + t for p in range(pp) for t in range(tp)]
        assert ranks == list(range(d * pp * tp, (d + 1) * pp * tp))
        assert all(topo.coord(r).dp == d for r in ranks)
        union += ranks
    assert sorted(union) == list(range(topo.world_size))


@pytest.mark.parametrize(
    "n_layers,n_stages,sizes",
    [
        (5, 2, [3, 2]),
        (4, 2, [2, 2]),
        (4, 4, [1, 1, 1, 1]),
        (7, 3, [3, 2, 2]),
        (8, 3, [3, 3, 2]),
        (6, 1, [6]),
        (10, 4, [3, 3, 2, 2]),
    ],
)
def test_split_layers(n_layers, n_stages, sizes):
    ranges = split_layers(n_layers, n_stages)
    assert [len(r) for r in ranges] == sizes
    # Contiguous, in order, covering every layer once.
    assert [i for r in ranges for i in r] == list(range(n_layers))
    assert all(r.step == 1 for r in ranges)


def test_split_layers_docstring_example():
    assert split_layers(5, 2) == [range(3), range(3, 5)]


@pytest.mark.parametrize(
    "pp,spr,expected",
    [
        (1, 1, [[0]]),
        (2, 1, [[0], [1]]),
        (4, 1, [[0], [1], [2], [3]]),
        (2, 2, [[0, 2], [1, 3]]),
        (4, 2, [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (2, 3, [[0, 2, 4], [1, 3, 5]]),
    ],
)
def test_stage_ids_loop(pp, spr, expected):
    got = [stage_ids(p, pp, spr) for p in range(pp)]
    assert got == expected
    assert got == [stage_ids(p, pp, spr, "loop") for p in range(pp)]
    assert sorted(s for ids in got for s in ids) == list(range(pp * spr))


@pytest.mark.parametrize("pp,expected", [(1, [[0, 1]]), (2, [[0, 3], [1, 2]]), (4, [[0, 7], [1, 6], [2, 5], [3, 4]])])
def test_stage_ids_v(pp, expected):
    got = [stage_ids(p, pp, 2, "v") for p in range(pp)]
    assert got == expected
    # The first and the last stage share pipeline rank 0; every stage is placed once.
    assert 0 in got[0] and 2 * pp - 1 in got[0]
    assert sorted(s for ids in got for s in ids) == list(range(2 * pp))


def test_stage_ids_v_needs_two_stages_per_rank():
    with pytest.raises((AssertionError, ValueError)):
        stage_ids(0, 2, 3, "v")


@pytest.mark.parametrize(
    "global_batch,dp,micro,expected",
    [(8, 1, 1, 8), (8, 2, 1, 4), (8, 2, 2, 2), (16, 2, 2, 4), (16, 4, 4, 1), (12, 3, 2, 2), (8, 8, 1, 1)],
)
def test_num_microbatches(global_batch, dp, micro, expected):
    assert num_microbatches(global_batch, dp, micro) == expected
    assert expected * dp * micro == global_batch


@pytest.mark.parametrize("global_batch,dp,micro", [(8, 3, 1), (8, 2, 3), (10, 4, 1), (2, 4, 1), (4, 1, 8), (0, 1, 1)])
def test_num_microbatches_rejects_indivisible(global_batch, dp, micro):
    with pytest.raises(ValueError, match="global_batch_size") as err:
        num_microbatches(global_batch, dp, micro)
    # The message names the keys to fix.
    assert "micro_batch_size" in str(err.value)


def _placement(topo: Topology, nodes: list[str]) -> list[dict]:
    """Rows as GroupState.placement gives them, rank r on nodes[r]."""
    rows = []
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        rows.append({"rank": rank, "dp": c.dp, "pp": c.pp, "tp": c.tp, "node_id": nodes[rank]})
    return rows


def test_hsdp_shard_groups_are_consecutive_dp_ranks_and_spanning_ones_are_found():
    """dp4 x tp2 with topology.dp_shard=2: the shard groups are dp (0, 1) and (2, 3) at each tp
    rank, i.e. ranks {0, 2}, {1, 3}, {4, 6}, {5, 7}; on two nodes of 4 ranks none spans; with
    the replicas placed alternately every group does."""
    topo = Topology(dp=4, pp=1, tp=2)
    assert groups_across_nodes(_placement(topo, ["a"] * 4 + ["b"] * 4), 2) == []
    assert groups_across_nodes(_placement(topo, ["a", "a", "b", "b"] * 2), 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_across_nodes(_placement(topo, ["a"] * 6 + ["b"] * 2), 2) == [[4, 6], [5, 7]]


def test_a_run_warns_in_one_line_when_an_hsdp_shard_group_spans_nodes(tmp_path, caplog):
    import dataclasses
    import logging

    from rayhybrid.config.schema import Config, TopologyConfig
    from rayhybrid.driver.runlog import RunLog

    cfg = dataclasses.replace(Config(topology=TopologyConfig(dp=4, dp_shard=2)), run_dir=str(tmp_path))
    first = {"device_name": "cpu", "backend": "gloo", "device": "cpu", "model_params": 1, "loss_floor": None}
    log = RunLog(cfg)
    topo = Topology(dp=4, pp=1, tp=1)
    with caplog.at_level(logging.WARNING, logger="rayhybrid"):
        log.workers(cfg, _placement(topo, ["a", "a", "b", "b"]), [1, 2, 3, 4], first)
        assert not caplog.records  # groups (0, 1) and (2, 3) each on one node
        log.workers(cfg, _placement(topo, ["a", "b", "a", "b"]), [1, 2, 3, 4], first)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "2 shard group(s) span nodes (ranks [0, 1])" in line and "topology.dp_shard" in line
    log.close("completed")
