"""Peer healing (fault.heal) where a failure strikes: during an evaluation, during the heal
itself, during the join of a recovery, during a checkpoint restore, two ranks of different
replicas at once, both copies of one shard (back to the checkpoint), and failures back to back. dp2_tp2: ranks 0 and 2 hold shard tp0, ranks 1 and 3
shard tp1. Kills come from outside with SIGKILL, except where only the injector can place
them (the start of an evaluation). Every run ends with the losses of an uninterrupted dp2_tp2
run, bit for bit; every teardown takes at most 2 s; every heal redoes no step."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

import rayhybrid
from tests.test_recovery import (  # noqa: F401 - local_ray: the module's Ray, shared with test_recovery
    COMMON,
    EVAL,
    KillInJoin,
    Logged,
    events,
    in_background,
    local_ray,
    losses,
    signal_rank,
    val_losses,
    when_step,
)

pytestmark = pytest.mark.slow

TOPOLOGY = ["+topology=dp2_tp2", *COMMON, *EVAL, "train.steps=12"]


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    summary = rayhybrid.train(TOPOLOGY, run_dir=tmp_path_factory.mktemp("ref"))
    return Path(summary["run_dir"])


def finished(result: dict, thread) -> dict:
    thread.join(timeout=400)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["steps"] == 12
    for recovery in summary["recoveries"]:
        assert recovery["teardown_s"] <= 2.0, recovery
        if "interrupted" in recovery:  # a recovery that failed before its first step
            continue
        assert recovery["healed"] in ("peer", "checkpoint"), recovery
        if recovery["healed"] == "peer":
            assert recovery["steps_redone"] == 0  # at the failed step when the survivors had stepped
            assert recovery["resume_step"] in (recovery["failed_step"] - 1, recovery["failed_step"])
    return summary


def test_kill_at_the_start_of_an_evaluation_is_healed(tmp_path, reference_dir):
    """Rank 1 dies as the evaluation after step 6 begins: every other rank has taken step 6,
    so the run heals forward to it (the driver never had step 6's results: they come from a
    rank that took it). Step 6's held-out loss is lost with the evaluation; the others match."""
    run_dir = tmp_path / "run"
    summary = rayhybrid.train([*TOPOLOGY, "fault.inject=[kill_eval@6:1]"], run_dir=run_dir)
    assert summary["status"] == "completed"
    (recovery,) = summary["recoveries"]
    assert (recovery["healed"], recovery["steps_redone"], recovery["resume_step"]) == ("peer", 0, 6)
    assert recovery["teardown_s"] <= 2.0 and recovery["replaced_ranks"] == [1]
    assert losses(run_dir) == losses(reference_dir)  # bitwise; every step once, 6 included
    expected = val_losses(reference_dir)
    assert val_losses(run_dir) == {step: loss for step, loss in expected.items() if step != 6}


def kill_two(run_dir: Path, ranks: tuple[int, int], after_step: int) -> dict:
    """A run in which `ranks` are SIGKILLed together after `after_step`; its summary."""
    thread, result = in_background(TOPOLOGY, run_dir)
    when_step(run_dir, after_step)
    for rank in ranks:
        signal_rank(run_dir, rank, signal.SIGKILL)
    return finished(result, thread)


def test_two_ranks_of_different_replicas_are_healed_from_each_other(tmp_path, reference_dir):
    """Ranks 1 (dp0, tp1) and 2 (dp1, tp0) SIGKILLed together: rank 3 sends tp1, rank 0 tp0."""
    run_dir = tmp_path / "run"
    summary = kill_two(run_dir, (1, 2), after_step=4)
    (recovery,) = summary["recoveries"]
    assert recovery["replaced_ranks"] == [1, 2] and recovery["healed"] == "peer"
    assert recovery["bytes_sent"] > 0
    (heal,) = events(run_dir, "heal")
    assert heal["ranks"] == [1, 2]
    assert losses(run_dir) == losses(reference_dir)


def test_both_copies_of_a_shard_lost_falls_back_to_the_checkpoint(tmp_path, reference_dir):
    """Ranks 1 and 3 hold the only two copies of shard tp1: the run restores the latest
    checkpoint and says how many completed steps it trains again."""
    run_dir = tmp_path / "run"
    summary = kill_two(run_dir, (1, 3), after_step=5)
    (recovery,) = summary["recoveries"]
    assert recovery["healed"] == "checkpoint" and recovery["resume_step"] in (3, 6)  # 6: if it was saved first
    assert recovery["steps_redone"] == recovery["failed_step"] - 1 - recovery["resume_step"]
    assert not events(run_dir, "heal")
    assert [e["step"] for e in events(run_dir, "resume")][-1] == recovery["resume_step"]
    assert losses(run_dir) == losses(reference_dir)


def test_kill_during_the_heal_recovers_again(tmp_path, reference_dir):
    """Rank 1 dies at step 5 (fault.inject); as the driver starts healing its replacement,
    rank 2 is SIGKILLed from outside. The heal fails, the group recovers again (from rank 0's
    copy of tp0, or from the checkpoint if the first heal had not reached rank 1), and the run
    ends exact."""
    run_dir = tmp_path / "run"
    healing = Logged("healing 1 rank(s)")
    logging.getLogger("rayhybrid").addHandler(healing)
    try:
        thread, result = in_background([*TOPOLOGY, "fault.inject=[kill@5:1]"], run_dir)
        assert healing.seen.wait(300), "no heal began"
        signal_rank(run_dir, 2, signal.SIGKILL)
        summary = finished(result, thread)
    finally:
        logging.getLogger("rayhybrid").removeHandler(healing)
    assert summary["restarts"] == 2
    first, second = summary["recoveries"]  # the first interrupted by the second failure
    assert first["failed_step"] == 5 and "rank 2" in first["interrupted"] and "interrupted" not in second
    assert 2 in second["replaced_ranks"] and second["healed"] in ("peer", "checkpoint")
    assert losses(run_dir) == losses(reference_dir)


def test_failures_back_to_back_are_each_healed(tmp_path, reference_dir):
    """Rank 1 dies at step 5 and rank 2 at step 6, the first step after the recovery."""
    run_dir = tmp_path / "run"
    summary = rayhybrid.train([*TOPOLOGY, "fault.inject=[kill@5:1,kill@6:2]"], run_dir=run_dir)
    assert summary["status"] == "completed" and summary["restarts"] == 2
    for recovery, rank in zip(summary["recoveries"], (1, 2)):
        assert recovery["replaced_ranks"] == [rank]
        assert (recovery["healed"], recovery["steps_redone"]) == ("peer", 0)
        assert recovery["teardown_s"] <= 2.0
    assert losses(run_dir) == losses(reference_dir)


def test_kill_during_the_join_of_a_recovery_leaves_at_once_and_heals(tmp_path, reference_dir):
    """Rank 1 dies at step 5; as the recovery's join begins, rank 2 is SIGKILLed from outside.
    The other ranks wait for it in the rendezvous; the driver closes the rendezvous store, they leave at once, and the next recovery heals both
    ranks from the copies that rank 0 (tp0) and rank 3 (tp1) kept. Before, they stayed blocked
    for the join's timeout and were replaced, and the run went back to its checkpoint."""
    run_dir = tmp_path / "run"
    with KillInJoin(run_dir, rank=2, nth=2) as watch:
        thread, result = in_background([*TOPOLOGY, "fault.inject=[kill@5:1]"], run_dir)
        summary = finished(result, thread)
    assert watch.killed.is_set()
    first, second = summary["recoveries"]
    assert "interrupted" in first and "interrupted" not in second, summary["recoveries"]
    assert 2 in second["replaced_ranks"] and (second["healed"], second["steps_redone"]) == ("peer", 0)
    assert losses(run_dir) == losses(reference_dir)


def test_kill_during_a_checkpoint_restore_recovers_again(tmp_path, reference_dir):
    """Ranks 1 and 3 (both copies of tp1) SIGKILLed after step 5: the run restores its
    checkpoint, and as that restore begins rank 0 is SIGKILLed from outside. The restore's
    collectives break, the ranks leave at once, the group recovers again from the checkpoint,
    and the run ends exact."""
    run_dir = tmp_path / "run"
    restoring = Logged("restoring the checkpoint")
    logging.getLogger("rayhybrid").addHandler(restoring)
    try:
        thread, result = in_background(TOPOLOGY, run_dir)
        when_step(run_dir, 5)
        for rank in (1, 3):
            signal_rank(run_dir, rank, signal.SIGKILL)
        assert restoring.seen.wait(300), "no checkpoint restore began"
        signal_rank(run_dir, 0, signal.SIGKILL)
        summary = finished(result, thread)
    finally:
        logging.getLogger("rayhybrid").removeHandler(restoring)
    first, second = summary["recoveries"]
    assert "interrupted" in first and "interrupted" not in second, summary["recoveries"]
    assert 0 in second["replaced_ranks"] and second["healed"] == "checkpoint"
    assert losses(run_dir) == losses(reference_dir)


HSDP = ["topology.dp=4", "topology.dp_shard=2", *COMMON, "train.steps=8"]
"""HSDP, dp4 as 2 replica groups x 2 shards: ranks 0 and 1 form one group, 2 and 3 the other;
rank 3 holds the shard rank 1 holds."""


def test_hsdp_rank_killed_heals_from_its_shard_in_the_other_group(tmp_path):
    """dp4 with topology.dp_shard=2, rank 1 SIGKILLed after step 3: its shard's copy lives on
    rank 3 (the same shard coordinate in the other replica group), so the run heals from it,
    redoes no step, and ends with an uninterrupted HSDP run's losses, bit for bit."""
    reference = Path(rayhybrid.train(HSDP, run_dir=tmp_path / "ref")["run_dir"])
    run_dir = tmp_path / "run"
    thread, result = in_background(HSDP, run_dir)
    when_step(run_dir, 3)
    signal_rank(run_dir, 1, signal.SIGKILL)
    thread.join(timeout=400)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["steps"] == 8
    (recovery,) = summary["recoveries"]
    assert (recovery["healed"], recovery["steps_redone"], recovery["replaced_ranks"]) == ("peer", 0, [1])
    assert recovery["bytes_sent"] > 0
    (heal,) = events(run_dir, "heal")
    assert heal["ranks"] == [1]
    assert losses(run_dir) == losses(reference)
