"""The workers' typed results (rayhybrid/trainer/results.py) and the group's merge of them
(rayhybrid/cluster/merge.py), without Ray or torch: what crosses the process boundary is a
plain frozen value, and the merged step keeps the saves of the rank whose figures it takes."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from rayhybrid.cluster.merge import merge_steps
from rayhybrid.trainer.results import HealResult, HeldState, RestoreResult, SaveResult, StepResult


def rank_metrics(rank: int, step: int = 3, **extra) -> dict:
    """What a rank's `train_step` reports of step `step` in a dp2 world of two-rank replicas."""
    first = 8 * (step - 1) + 4 * (rank // 2)
    return {"step": step, "loss": 0.5, "consumed_samples": 8 * step, "dp": 2, "samples_read": [first, 4]} | extra


def test_the_merged_step_keeps_rank_0s_saves_and_every_ranks_figures():
    committed = SaveResult(2, "/c/step_00000002", True, 0.0, blocked_s=0.1, upload_s=0.4)
    mine_only = SaveResult(2, "/c/step_00000002", True, 0.0, blocked_s=0.1, upload_s=0.3)  # rank 1's own view
    results = [
        [StepResult(rank_metrics(0, data_wait_s=0.1, cpu_s=0.2), (committed,))],
        [StepResult(rank_metrics(1, data_wait_s=0.3, cpu_s=0.1), (mine_only,))],
        None,  # a rank with no record of the step
        [StepResult(rank_metrics(3, data_wait_s=0.2, cpu_s=0.5))],
    ]
    (merged,) = merge_steps(results, dp=2, replica_size=2)
    assert isinstance(merged, StepResult) and merged.saves == (committed,)
    m = merged.metrics
    assert m["samples"] == [[16, 4], [20, 4]] and "samples_read" not in m
    assert (m["data_wait_s"], m["cpu_s"]) == (0.3, 0.5)  # the slowest rank's
    assert results[0][0].metrics["samples_read"] == [16, 4]  # the ranks' own results are left as they were


def test_a_step_healed_forward_keeps_the_saves_of_the_rank_that_trained_it():
    """After a heal, rank 0 may be a rank that received its state (it reports only the samples
    it read, and no saves); the merged step's figures and saves are both those of the rank that
    took the step and kept its results, as the driver read them before the results were typed."""
    committed = SaveResult(2, "/c/step_00000002", True, 0.0, blocked_s=0.1, upload_s=0.4)
    received = {"step": 3, "consumed_samples": 24, "samples_read": [16, 4]}
    results = [
        [StepResult(received)],
        [StepResult(rank_metrics(1, loss=0.25), (committed,))],
        [StepResult(rank_metrics(2))],
        [StepResult(rank_metrics(3))],
    ]
    (merged,) = merge_steps(results, dp=2, replica_size=2)
    assert merged.metrics["loss"] == 0.25 and merged.saves == (committed,)


def test_a_step_with_no_save_that_ended_merges_to_none():
    (merged,) = merge_steps([[StepResult(rank_metrics(r))] for r in range(4)], dp=2, replica_size=2)
    assert merged.saves == ()


def test_a_save_is_pending_until_its_upload_ends_or_fails():
    staged = SaveResult(4, "s3://b/step_00000004", True, 0.0, blocked_s=0.2)
    assert staged.pending
    assert not dataclasses.replace(staged, upload_s=1.0).pending
    assert not dataclasses.replace(staged, error="OSError: disk full").pending
    with pytest.raises(dataclasses.FrozenInstanceError):
        staged.step = 5


@pytest.mark.parametrize(
    "value",
    [
        StepResult({"step": 1, "loss": 2.0}, (SaveResult(1, "/c", False, 0.0, 0.1, 0.2),)),
        SaveResult(1, "/c", True, 0.0, finished=(SaveResult(0, "/b", True, 0.0, 0.1, 0.2),)),
        HeldState(6, 100, True),
        HealResult(6, StepResult({"step": 6}), 100, 0.5),
        RestoreResult(4, 32, 1.5),
    ],
)
def test_results_cross_a_process_boundary_unchanged(value):
    assert pickle.loads(pickle.dumps(value)) == value


def test_the_results_import_neither_torch_nor_ray():
    """The driver imports them and never imports torch; they cross Ray's boundary as data."""
    code = (
        "import sys, rayhybrid.trainer.results, rayhybrid.cluster.merge; assert not {'torch', 'ray'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
