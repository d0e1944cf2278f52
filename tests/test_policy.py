"""The driver's rules (rayhybrid/policy.py) as pure functions: restart or give up after a
failure, and which replica slots to start on, shrink to and grow to. No Ray."""

from __future__ import annotations

import pytest

from rayhybrid.driver.policies import Failure, FailurePolicy, HealPolicy, ScalingPolicy

NODE_LOST = "rank 3: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"
NO_GROUP = "rank 1: ValueError: Could not resolve the process group registered under the name 11"
OOM = "rank 2: RuntimeError: out of memory allocating 1048576 bytes"


# -- FailurePolicy ------------------------------------------------------------------------


@pytest.mark.parametrize("max_restarts, restarts", [(1, 0), (3, 0), (3, 1), (3, 2)])
def test_restarts_while_restarts_are_left(max_restarts, restarts):
    decision = FailurePolicy(max_restarts).decide(Failure(5, OOM), [], restarts)
    assert decision.restart and decision.reason == ""


@pytest.mark.parametrize("max_restarts, restarts", [(3, 3), (3, 4), (1, 1), (0, 0)])
def test_gives_up_when_restarts_are_used_up(max_restarts, restarts):
    decision = FailurePolicy(max_restarts).decide(Failure(5, OOM), [], restarts)
    assert not decision.restart
    assert f"fault.max_restarts={max_restarts}" in decision.reason
    assert f"after {restarts} restart(s)" in decision.reason
    assert decision.reason.endswith(OOM)


def test_max_restarts_zero_gives_up_at_the_first_failure():
    decision = FailurePolicy(0).decide(Failure(1, NODE_LOST, external=True), [], 0)
    assert not decision.restart and "fault.max_restarts=0" in decision.reason


def test_a_repeated_failure_gives_up():
    earlier = [Failure(7, OOM)]
    decision = FailurePolicy(3).decide(Failure(7, OOM), earlier, 1)
    assert not decision.restart
    assert decision.reason.startswith("step 7 failed twice")
    assert decision.reason.endswith(OOM)


def test_a_repeat_of_any_earlier_failure_counts():
    earlier = [Failure(3, NODE_LOST), Failure(7, OOM), Failure(9, NO_GROUP)]
    assert not FailurePolicy(5).decide(Failure(7, OOM), earlier, 3).restart


@pytest.mark.parametrize(
    "earlier, now",
    [
        # the same cause at another step: a restart made progress
        (Failure(7, OOM), Failure(8, OOM)),
        (Failure(8, OOM), Failure(7, OOM)),
        # another cause at the same step (the case: a node loss, then the group it left behind)
        (Failure(9, NODE_LOST), Failure(9, NO_GROUP)),
        (Failure(9, NO_GROUP), Failure(9, NODE_LOST)),
        (Failure(9, "rank 0: RuntimeError: boom"), Failure(9, "rank 0: ValueError: boom")),
    ],
)
def test_a_different_failure_restarts(earlier, now):
    assert FailurePolicy(3).decide(now, [earlier], 1).restart


@pytest.mark.parametrize(
    "first, second",
    [
        (NODE_LOST, NODE_LOST.replace("41234", "50001")),  # port
        (NODE_LOST, NODE_LOST.replace("127.0.0.1", "10.0.12.7")),  # address
        (NODE_LOST, NODE_LOST.replace("rank 3", "rank 11")),  # rank
        (NO_GROUP, NO_GROUP.replace("name 11", "name 23")),  # group name
        ("rank 0: hung at step 4 for 300s", "rank 7: hung at step 4 for 301s"),
    ],
)
def test_messages_that_differ_only_in_numbers_are_the_same_cause(first, second):
    assert Failure(9, first).signature == Failure(9, second).signature
    assert Failure(9, second).repeats(Failure(9, first))
    decision = FailurePolicy(3).decide(Failure(9, second), [Failure(9, first)], 1)
    assert not decision.restart and "step 9 failed twice" in decision.reason


def test_signature_masks_every_number():
    assert Failure(1, "rank 12: port 4000 on 10.0.0.1").signature == "rank #: port # on #.#.#.#"
    assert Failure(1, "no numbers").signature == "no numbers"


@pytest.mark.parametrize("earlier_external, now_external", [(True, False), (False, True), (True, True)])
def test_an_external_failure_is_never_a_repeat(earlier_external, now_external):
    earlier = Failure(9, NODE_LOST, external=earlier_external)
    now = Failure(9, NODE_LOST, external=now_external)
    assert not now.repeats(earlier)
    assert FailurePolicy(3).decide(now, [earlier], 1).restart


def test_internal_failures_repeat_both_ways():
    a, b = Failure(9, NODE_LOST), Failure(9, NODE_LOST.replace("41234", "1"))
    assert a.repeats(b) and b.repeats(a)


def test_the_max_restarts_check_comes_first():
    decision = FailurePolicy(2).decide(Failure(7, OOM), [Failure(7, OOM)], 2)
    assert not decision.restart
    assert "fault.max_restarts=2" in decision.reason and "failed twice" not in decision.reason


# -- ScalingPolicy ------------------------------------------------------------------------

POW2 = ScalingPolicy([1, 2, 4], 1)  # a batch that 3 replicas cannot split
UPTO3 = ScalingPolicy([1, 2, 3], 1)
POW2_MIN2 = ScalingPolicy([1, 2, 4], 2)
FIXED = ScalingPolicy([2], 2, elastic=False)


@pytest.mark.parametrize("policy, slots", [(POW2, 4), (UPTO3, 3), (FIXED, 2), (ScalingPolicy([2, 4, 8], 2), 8)])
def test_slots_is_the_largest_usable_dp(policy, slots):
    assert policy.slots == slots


@pytest.mark.parametrize(
    "policy, replicas, dp",
    [
        (POW2, 0, 0),
        (POW2, 1, 1),
        (POW2, 2, 2),
        (POW2, 3, 2),
        (POW2, 4, 4),
        (POW2, 9, 4),
        (UPTO3, 3, 3),
        (FIXED, 1, 0),
        (FIXED, 2, 2),
        (FIXED, 5, 2),
    ],
)
def test_fit(policy, replicas, dp):
    assert policy.fit(replicas) == dp


@pytest.mark.parametrize(
    "policy, placed, slots",
    [
        (POW2, [0, 1, 2, 3], [0, 1, 2, 3]),
        (POW2, [0, 1, 2], [0, 1]),  # 3 cannot split the batch
        (POW2, [3, 1, 2], [3, 1]),  # in slot order as given
        (POW2, [2], [2]),
        (POW2, [], []),
        (UPTO3, [0, 1, 2], [0, 1, 2]),
        (UPTO3, [0, 2], [0, 2]),
        (POW2_MIN2, [0, 1, 2], [0, 1]),
        (POW2_MIN2, [1], []),  # fewer than min_dp
        (ScalingPolicy([1, 2, 4], 3), [0, 1, 2], []),  # fits only 2 < min_dp 3
        (FIXED, [0, 1], [0, 1]),
        (FIXED, [1], []),
        (FIXED, [], []),
    ],
)
def test_on_start(policy, placed, slots):
    assert policy.on_start(placed) == slots


@pytest.mark.parametrize(
    "policy, active, lost, slots",
    [
        (UPTO3, [0, 1, 2], {1}, [0, 2]),
        (UPTO3, [2, 0, 1], {0}, [2, 1]),  # survivors keep their order
        (UPTO3, [0, 1, 2], {0, 1}, [2]),
        (UPTO3, [0, 1, 2], {0, 1, 2}, []),
        (POW2, [0, 1, 2, 3], {2}, [0, 1]),  # 3 survivors cut to 2
        (POW2, [0, 1, 2, 3], {0}, [1, 2]),
        (POW2, [0, 1], {1}, [0]),
        (POW2_MIN2, [0, 1], {0}, []),  # below min_dp
        (POW2_MIN2, [0, 1, 2, 3], {1, 2, 3}, []),
        (POW2_MIN2, [0, 1, 2, 3], {3}, [0, 1]),
        (FIXED, [0, 1], {1}, []),  # a fixed-size run never shrinks
        (FIXED, [0, 1], {0, 1}, []),
        # nothing lost keeps everything
        (FIXED, [0, 1], set(), [0, 1]),
        (UPTO3, [0, 1, 2], set(), [0, 1, 2]),
        (POW2, [3, 0], frozenset(), [3, 0]),
    ],
)
def test_on_loss(policy, active, lost, slots):
    assert policy.on_loss(active, lost) == slots


@pytest.mark.parametrize(
    "policy, active, placed, slots",
    [
        (FIXED, [0, 1], [0, 1], None),
        (ScalingPolicy([1, 2], 1, elastic=False), [0], [0, 1], None),  # fixed: never grows
        (UPTO3, [0, 1, 2], [0, 1, 2], None),  # no spare
        (POW2, [0, 1], [0, 1], None),
        (POW2, [0, 1], [0, 1, 2], None),  # one spare does not reach dp 4
        (POW2, [0, 2], [0, 1, 2], None),
        (UPTO3, [0, 2], [0, 1, 2], [0, 2, 1]),  # new slots last
        (UPTO3, [2], [0, 1, 2], [2, 0, 1]),
        (UPTO3, [1], [0, 1], [1, 0]),
        (POW2, [0, 1], [0, 1, 2, 3], [0, 1, 2, 3]),
        (POW2, [3, 1], [0, 1, 2, 3], [3, 1, 0, 2]),
        (POW2, [0], [0, 1, 2], [0, 1]),  # grows as far as a usable dp: 2 of the 3 placed
        (POW2, [2], [0, 1, 2, 3], [2, 0, 1, 3]),
    ],
)
def test_on_checkpoint(policy, active, placed, slots):
    assert policy.on_checkpoint(active, placed) == slots


HSDP2 = ScalingPolicy([2, 4, 6], 2, group=2)  # topology.dp_shard=2, elastic dp 2..6


@pytest.mark.parametrize(
    "active, lost, slots",
    [
        ([0, 1, 2, 3], {1}, [2, 3]),  # the group that lost none, not [0, 2]
        ([0, 1, 2, 3], {2}, [0, 1]),
        ([0, 1, 2, 3, 4, 5], {3}, [0, 1, 4, 5]),  # groups (0, 1), (4, 5) keep their shards
        ([0, 1, 2, 3, 4, 5], {1, 3}, [4, 5, 0, 2]),  # then a new group of what is left
        ([0, 1, 2, 3, 4, 5], {0, 2, 4}, [1, 3]),  # no whole group left: the survivors form one
        ([0, 1, 2, 3], {0, 2, 3}, []),  # one replica is no group (below min_dp 2)
        ([3, 2, 1, 0], {0}, [3, 2]),
        ([0, 1, 2, 3], set(), [0, 1, 2, 3]),
    ],
)
def test_hsdp_shrinks_by_whole_shard_groups(active, lost, slots):
    assert HSDP2.on_loss(active, lost) == slots


@pytest.mark.parametrize(
    "active, placed, slots",
    [
        ([0, 1], [0, 1, 2], None),  # one spare is not a group
        ([0, 1], [0, 1, 2, 3], [0, 1, 2, 3]),
        ([2, 3], [0, 1, 2, 3, 4, 5], [2, 3, 0, 1, 4, 5]),
    ],
)
def test_hsdp_grows_by_whole_shard_groups(active, placed, slots):
    assert HSDP2.on_checkpoint(active, placed) == slots


def test_hsdp_policy_of_a_config_uses_whole_groups_only():
    from rayhybrid.preflight import load_config

    cfg = load_config(
        ["topology.dp=6", "topology.dp_shard=2", "elastic.enabled=true", "elastic.min_dp=2"]
        + ["train.global_batch_size=24", "train.micro_batch_size=1"]
    )
    policy = ScalingPolicy.of(cfg)
    assert (list(policy.usable), policy.min_dp, policy.group) == ([2, 4, 6], 2, 2)
    assert policy.fit(5) == 4


def test_an_elastic_hsdp_run_announces_whole_groups(caplog):
    import logging

    from rayhybrid.driver.runlog import announce
    from rayhybrid.preflight import load_config

    cfg = load_config(
        ["topology.dp=4", "topology.dp_shard=2", "elastic.enabled=true", "elastic.min_dp=2", "elastic.max_dp=6"]
        + ["train.global_batch_size=24", "train.micro_batch_size=1"]
    )
    with caplog.at_level(logging.INFO, logger="rayhybrid"):
        announce(cfg, ScalingPolicy.of(cfg), use_gpu=False)
    first, second = (r.getMessage() for r in caplog.records)
    assert "usable dp 2, 4, 6; HSDP: dp grows and shrinks by whole shard groups of 2" in first
    assert "cannot split" not in first  # 3 and 5 are not skipped for the batch's sake
    assert "HSDP (2 replicas x 2 shards)" in second


def test_the_module_docstring_example():
    scaling = ScalingPolicy(usable=[1, 2, 3], min_dp=1, elastic=True)
    assert scaling.on_start(placed=[0, 1]) == [0, 1]
    assert scaling.on_loss(active=[0, 1, 2], lost={1}) == [0, 2]
    assert scaling.on_checkpoint(active=[0, 2], placed=[0, 1, 2]) == [0, 2, 1]


# -- Which failure the worker group reports ------------------------------------------------
# (rayhybrid/cluster/calls.py: the rank that failed first, not a peer that lost its connection
# to it; FailurePolicy's repeat rule compares these causes.)

PEER_GONE = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:62605"
OUT_OF_MEMORY = "OutOfMemoryError: the step needs 13.2 MB but tune.memory_budget_mb is 12"


def test_the_error_that_happened_first_is_reported_not_its_peers():
    from rayhybrid.cluster.calls import first_failure

    # Rank 0 ran out of memory and left the group; rank 1's collective then broke. Ray may hand
    # back rank 1's error first: the time each happened decides, not the order of arrival.
    err = first_failure([(0, OUT_OF_MEMORY, 100.20), (1, PEER_GONE, 100.25)])
    assert (err.rank, err.message) == (0, OUT_OF_MEMORY)
    err = first_failure([(0, PEER_GONE, 100.25), (1, OUT_OF_MEMORY, 100.20)])
    assert (err.rank, err.message) == (1, OUT_OF_MEMORY)


def test_a_worker_that_died_is_reported_before_errors_with_times():
    from rayhybrid.cluster.calls import first_failure

    died = "worker died: The actor died unexpectedly before finishing this task"
    err = first_failure([(0, PEER_GONE, 100.1), (3, died, None), (5, PEER_GONE, 100.0)])
    assert (err.rank, err.message) == (3, died)


def test_a_rank_failure_keeps_its_time_across_processes():
    import pickle

    from rayhybrid.errors import RankFailed

    copy = pickle.loads(pickle.dumps(RankFailed(OUT_OF_MEMORY, 1795510000.5)))
    assert (str(copy), copy.at) == (OUT_OF_MEMORY, 1795510000.5)


def test_heal_goes_forward_to_the_newest_step_every_shard_still_has():
    heal = HealPolicy(enabled=True)
    # Shard a: replica 1 lost it; shard b: replica 0 stepped past the vote, replica 1 did not.
    plan = heal.choose({"a": [7, None, 7], "b": [7, 6, None]})
    assert plan.step == 7 and plan.sources == {"a": {1: 0}, "b": {1: 0, 2: 0}}
    # Receivers are spread over the replicas that hold the step.
    assert heal.choose({"a": [5, 5, None, None]}).sources == {"a": {2: 0, 3: 1}}
    # Every copy in place (a replica dropped whole, an elastic shrink): nothing to send.
    assert heal.choose({"a": [5, 5], "b": [5, 5]}).sources == {}


def test_heal_falls_back_to_the_checkpoint_when_a_shard_has_no_copy_or_heal_is_off():
    heal = HealPolicy(enabled=True)
    assert heal.choose({"a": [7, None], "b": [None, None]}) is None  # both copies of b lost
    assert heal.choose({"a": [7, None], "b": [6, None]}) is None  # b has no copy of step 7
    assert heal.choose({"a": [None, None]}) is None  # nothing kept (dp=1, dp_shard, a new group)
    assert heal.choose({"a": [3, 3]}, checkpoint_step=5) is None  # a newer checkpoint wins
    assert heal.choose({"a": [5, None]}, checkpoint_step=5).step == 5
    assert HealPolicy(enabled=False).choose({"a": [7, None]}) is None
