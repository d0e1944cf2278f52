"""Elastic data parallelism on a `ray.cluster_utils.Cluster`: a replica's node goes (dp 3 -> 2),
a node comes back (dp 2 -> 3); the global batch, the learning-rate schedule and the sample stream
stay the same, so the losses match a fixed-dp run and every sample is used once, in order."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

import rayhybrid
from benchmarks.clusters import add_node, local_cluster
from rayhybrid.config.compose import compose, to_config
from rayhybrid.config.validate import usable_dps
from rayhybrid.driver.controller import RunFailed
from rayhybrid.errors import ConfigError
from rayhybrid.preflight import check
from tests.test_recovery import KillInJoin, in_background, losses, when_step
from tests.test_wallclock import adds_up

# A replica is pp2 x tp1: two ranks, one node of 2 CPUs. G=12 splits for dp 1, 2 and 3.
COMMON = [
    "topology.pp=2",
    "train.global_batch_size=12",
    "train.micro_batch_size=2",
    "data.seq_len=32",
    "checkpoint.every=2",
]
ELASTIC = ["elastic.enabled=true", "elastic.min_dp=1", "elastic.max_dp=3", "elastic.reschedule_timeout_s=5"]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == kind]


def wait_for(predicate, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(head_cpus=0, node_cpus=[2, 2, 2]) as (c, _):
        yield c


def node_of(run_dir: Path, dp: int, cluster: Cluster):
    workers = json.loads((run_dir / "workers.json").read_text())
    node_id = next(w["node_id"] for w in workers if w["dp"] == dp)
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


@pytest.mark.slow
@pytest.mark.parametrize("model", [["model=llama3_debug"]], ids=["llama3"])
def test_shrinks_when_a_node_goes_and_grows_when_one_comes_back(cluster, tmp_path, model):
    # On the Llama debug preset; the GPT shrinks and grows in tests/test_soak.py (tp2 and pp2
    # replicas), tests/test_storage_cluster.py and tests/test_preemption.py.
    steps = 40
    common = [*model, *COMMON]
    reference = rayhybrid.train([*common, f"train.steps={steps}"], run_dir=tmp_path / "ref")  # fixed dp1
    assert reference["status"] == "completed"

    run_dir = tmp_path / "run"
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 6)  # the reference run's are back
    thread, result = in_background([*common, *ELASTIC, f"train.steps={steps}"], run_dir)
    # Elastic starts with what is placed, and grows at a checkpoint if the rest comes soon after.
    wait_for(lambda: any(r.get("dp") == 3 for r in records(run_dir) if "event" not in r))
    cluster.remove_node(node_of(run_dir, 1, cluster))
    wait_for(lambda: [e for e in events(run_dir, "resize") if e["to_dp"] == 2])  # shrunk without waiting
    add_node(cluster, 2)
    thread.join(timeout=600)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert summary["topology"]["dp"] == 3 and summary["topology"]["num_microbatches"] == 2  # as it ended

    *_, shrink, grow = summary["resizes"]
    assert (shrink["from_dp"], shrink["to_dp"]) == (3, 2) and "replica lost" in shrink["cause"]
    assert (grow["from_dp"], grow["to_dp"]) == (2, 3) and "placed" in grow["cause"]
    assert grow["step"] % 2 == 0  # a grow waits for a checkpoint boundary and restores from it
    # The shrink continues from memory at the step the failure interrupted (the two replicas
    # left hold every shard): no step trained again, no checkpoint loaded.
    restart = next(r for r in summary["recoveries"] if r["dp_after"] == 2)
    assert restart["healed"] == "peer" and restart["steps_redone"] == 0
    # The failed step itself when the ranks left had passed its commit vote (they stepped).
    assert shrink["step"] == restart["resume_step"] in (restart["failed_step"] - 1, restart["failed_step"])
    assert shrink["resize_s"] > 0 and grow["resize_s"] > 0
    assert [e["to_dp"] for e in events(run_dir, "resize")][-2:] == [2, 3]
    seconds = adds_up(summary)  # goodput across a shrink (a restart that resized: counted once) and a grow
    assert seconds["worker_init"] > 0 and seconds["detection"] > 0 and seconds["checkpoint"] > 0

    step_records = [r for r in records(run_dir) if "event" not in r]
    assert [r["step"] for r in step_records] == list(range(1, steps + 1))
    dps = [r["dp"] for r in step_records]
    assert 2 in dps and dps[-1] == 3 and dps[dps.index(2) - 1] == 3
    # Exactly-once data: each step's replicas read consecutive ranges that tile its 12 samples,
    # and the steps follow each other, so the run reads samples 0..12*steps-1 once, in order.
    for r in step_records:
        ranges = r["samples"]
        assert len(ranges) == r["dp"] and sum(count for _, count in ranges) == 12
        expected = 12 * (r["step"] - 1)
        for start, count in ranges:
            assert start == expected
            expected += count
    # The training mathematics did not change: same losses as the fixed-dp run.
    assert losses(run_dir) == pytest.approx(losses(tmp_path / "ref"), rel=1e-5)


@pytest.mark.slow
def test_kill_during_a_grow_leaves_at_once(cluster, tmp_path):
    """An elastic run starts on two replicas (a placement group holds the third node), grows to
    three when it is released, and a rank is SIGKILLed from outside half a second into the
    grow's join. The ranks waiting for it leave at once (the drain closes the rendezvous), the
    run recovers, and it ends with every sample read once and the losses of a fixed run."""
    from ray.util.placement_group import placement_group, remove_placement_group

    steps = 30
    wait_for(lambda: sum(n["Alive"] and n["Resources"].get("CPU", 0) > 0 for n in ray.nodes()) == 3)
    reference = rayhybrid.train([*COMMON, f"train.steps={steps}"], run_dir=tmp_path / "ref")
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 6)
    holder = placement_group([{"CPU": 2}], strategy="STRICT_PACK")
    ray.get(holder.ready(), timeout=60)
    run_dir = tmp_path / "run"
    with KillInJoin(run_dir, rank=1, after="resize dp") as watch:  # the grow's join
        thread, result = in_background([*COMMON, *ELASTIC, f"train.steps={steps}"], run_dir)
        when_step(run_dir, 3)
        remove_placement_group(holder)
        thread.join(timeout=600)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert watch.killed.is_set() and summary["status"] == "completed"
    # The grow never finished: the recovery from the kill carries the run on at dp 3, from the
    # checkpoint written for the grow.
    (recovery,) = summary["recoveries"]
    assert recovery["teardown_s"] <= 2.0 and recovery["dp_after"] == 3, recovery
    assert (recovery["healed"], recovery["steps_redone"]) == ("checkpoint", 0)
    adds_up(summary)  # goodput across a grow interrupted and its recovery
    step_records = [r for r in records(run_dir) if "event" not in r]
    assert [r["step"] for r in step_records] == list(range(1, steps + 1))
    dps = [r["dp"] for r in step_records]
    assert dps[0] == 2 and dps[-1] == 3 and dps[recovery["failed_step"] - 1] == 3
    for r in step_records:  # exactly once, in order
        expected = 12 * (r["step"] - 1)
        for start, count in r["samples"]:
            assert start == expected
            expected += count
    assert losses(run_dir) == pytest.approx(losses(Path(reference["run_dir"])), rel=1e-5)


@pytest.mark.slow
def test_fixed_dp_run_fails_clearly_when_a_node_is_gone_for_good(cluster, tmp_path):
    wait_for(lambda: sum(n["Alive"] and n["Resources"].get("CPU", 0) > 0 for n in ray.nodes()) == 3)
    run_dir = tmp_path / "run"
    thread, result = in_background(
        [*COMMON, "topology.dp=3", "train.steps=200", "cluster.placement_timeout_s=5"], run_dir
    )
    when_step(run_dir, 3)
    wait_for(lambda: events(run_dir, "checkpoint"))  # the step-2 upload is committed
    cluster.remove_node(node_of(run_dir, 2, cluster))
    thread.join(timeout=300)
    err = result.get("error")
    assert isinstance(err, RunFailed), result
    assert "could not be placed again" in str(err) and "last good checkpoint" in str(err)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    add_node(cluster, 2)


def _cfg(*overrides: str):
    return to_config(compose(list(overrides)))


def test_usable_dps_follow_the_global_batch():
    cfg = _cfg(*ELASTIC, "train.global_batch_size=8", "train.micro_batch_size=1", "elastic.max_dp=4")
    assert usable_dps(cfg) == [1, 2, 4]  # dp 3 cannot split 8 samples
    check(cfg)
    # 1F1B needs pp micro-batches per replica: dp 4 leaves one each.
    cfg = _cfg(*ELASTIC, "topology.pp=2", "train.global_batch_size=8", "train.micro_batch_size=2", "elastic.max_dp=4")
    assert usable_dps(cfg) == [1, 2]


def test_elastic_config_errors_name_the_setting():
    with pytest.raises(ConfigError) as info:
        check(
            _cfg(
                *ELASTIC,
                "elastic.min_dp=3",
                "elastic.max_dp=3",
                "train.global_batch_size=8",
                "train.micro_batch_size=1",
            )
        )
    assert info.value.setting == "elastic.min_dp" and "valid dp values: 1, 2, 4, 8" in str(info.value)
    with pytest.raises(ConfigError) as info:
        check(_cfg(*ELASTIC, "elastic.min_dp=3", "elastic.max_dp=2"))
    assert info.value.setting == "elastic.max_dp"
    with pytest.raises(ConfigError) as info:
        check(_cfg(*ELASTIC, "elastic.min_dp=0"))
    assert info.value.setting == "elastic.min_dp"
