"""A worker process outlives its world: recovery keeps the survivors and an elastic resize
renumbers them. Here six processes go through dp3 -> dp2 -> dp3 worlds of tp2 replicas, the
way an elastic run does when a node goes and comes back: the replica that was third becomes
second, and the returning one is last. No Ray: plain processes run `TrainWorker` directly."""

from __future__ import annotations

import pytest

from rayhybrid.config.compose import compose, to_config
from rayhybrid.config.schema import with_dp
from tests.distributed import run_worlds

pytestmark = pytest.mark.slow  # Ray or several processes; see the quick tier in README.md


def test_worker_rejoins_a_world_of_the_same_shape_under_another_rank():
    # vocab 8192 puts the loss on the tensor-parallel sharded logits (loss_parallel=auto).
    base = to_config(
        compose(
            [
                "topology.tp=2",
                "train.global_batch_size=12",
                "train.micro_batch_size=2",
                "data.seq_len=16",
                "model.vocab_size=8192",
            ]
        )
    )
    worlds = [
        {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5},  # dp3: replicas in slots 0, 1, 2
        {0: 0, 1: 1, 4: 2, 5: 3},  # slot 1's node is gone: dp2 on slots 0, 2
        {0: 0, 1: 1, 4: 2, 5: 3, 2: 4, 3: 5},  # it is back, last: dp3 on slots 0, 2, 1
    ]
    losses = run_worlds([with_dp(base, 3), with_dp(base, 2), with_dp(base, 3)], worlds, num_procs=6)
    # Before the fix, processes 4 and 5 failed in the third world: DTensor's sharding cache
    # handed back a mesh of the first world, whose tp group (they were ranks 4, 5) they no
    # longer belong to ("Could not resolve the process group registered under the name 11").
    first, third = losses[0][0], losses[0][-1]
    assert all(len(losses[p]) == (3 if p in (0, 1, 4, 5) else 2) for p in range(6))
    # Every world trains step 1 from the same initial weights: the same dp gives the same loss.
    assert all(losses[p][0] == first and losses[p][-1] == third for p in range(6))
    assert third == first
