"""Warm standby workers (fault.standby, rayhybrid/cluster/standby.py): a rank SIGKILLed from
outside is replaced by a standby's process, started before the kill, and the recovery's init
phase is a fraction of a cold start's; a standby killed from outside is replaced without
interrupting the run; a standby killed as it takes a rank over still ends in a recovered run.
Every run ends with an uninterrupted run's losses."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import ray
from test_recovery import in_background, losses, signal_rank, when_step

import rayhybrid
from rayhybrid.cluster.placement import ReplicaShape
from rayhybrid.cluster.reservation import Reservation
from rayhybrid.cluster.standby import NAME_PREFIX, Standbys, adoptable
from rayhybrid.cluster.worker import CONTROL, TrainWorker
from rayhybrid.preflight import load_config
from tests.clusters import warm_standbys

pytestmark = pytest.mark.slow  # Ray and several processes

# This module's Ray declares 2 GPUs (for the GPU ids a standby takes over); the runs train on the CPU.
COMMON = [
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "data.seq_len=32",
    "checkpoint.every=0",
    "cluster.use_gpu=false",
]
STEPS = 300  # steps of 0.04 s: long enough for a standby to be ready (its imports: seconds)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """An uninterrupted run on one rank (parity makes its losses those of every topology)."""
    run_dir = tmp_path_factory.mktemp("ref")
    rayhybrid.train([*COMMON, f"train.steps={STEPS}", "fault.standby=0"], run_dir=run_dir)
    return losses(run_dir)


def finished(thread, result) -> dict:
    thread.join(timeout=400)
    summary = result.get("summary")
    assert summary is not None, result.get("error")
    assert summary["status"] == "completed"
    return summary


def pids(run_dir: Path) -> list[int]:
    return [w["pid"] for w in json.loads((run_dir / "workers.json").read_text())]


def killed_rank(tmp_path: Path, name: str, standby: int) -> tuple[dict, Path, dict]:
    """dp2 with `fault.standby=standby`, rank 1 SIGKILLed once a standby is warm (with
    standbys) or after step 3 (without): the summary, the run dir and the standbys before."""
    run_dir = tmp_path / name
    thread, result = in_background(
        ["+topology=dp2", *COMMON, f"train.steps={STEPS}", f"fault.standby={standby}"], run_dir
    )
    when_step(run_dir, 3)
    before = warm_standbys() if standby else {}
    signal_rank(run_dir, 1, signal.SIGKILL)
    return finished(thread, result), run_dir, before


def test_killed_rank_is_replaced_by_a_warm_standby(tmp_path, reference):
    """The replacement of the SIGKILLed rank is the standby's process (its pid was a standby's
    before the kill), and the recovery's init phase is well under a cold start's, measured in
    this test with fault.standby=0."""
    warm, run_dir, before = killed_rank(tmp_path, "warm", standby=1)
    (recovery,) = warm["recoveries"]
    assert recovery["replaced_ranks"] == [1]
    assert pids(run_dir)[1] in before.values()
    assert losses(run_dir) == pytest.approx(reference, rel=1e-5)

    cold, cold_dir, _ = killed_rank(tmp_path, "cold", standby=0)
    (cold_recovery,) = cold["recoveries"]
    assert not [n for n in ray.util.list_named_actors() if n.startswith(NAME_PREFIX)]  # none started, none left
    assert losses(cold_dir) == pytest.approx(reference, rel=1e-5)
    ratio = recovery["init_s"] / cold_recovery["init_s"]
    print(f"init: warm standby {recovery['init_s']:.2f}s, cold start {cold_recovery['init_s']:.2f}s ({ratio:.2f}x)")
    assert ratio < 0.5, (recovery["init_s"], cold_recovery["init_s"])


def test_killed_standby_is_replaced_and_the_run_goes_on(tmp_path, reference):
    """A warm standby SIGKILLed from outside: another takes its place, no rank is touched, no
    recovery happens."""
    run_dir = tmp_path / "run"
    thread, result = in_background(["+topology=dp2", *COMMON, f"train.steps={STEPS}"], run_dir)
    when_step(run_dir, 2)
    first = warm_standbys()
    ranks = pids(run_dir)
    for pid in first.values():
        os.kill(pid, signal.SIGKILL)
    second = warm_standbys(but=frozenset(first))
    assert set(second.values()).isdisjoint(first.values())
    summary = finished(thread, result)
    assert summary["restarts"] == 0 and pids(run_dir) == ranks
    assert losses(run_dir) == pytest.approx(reference, rel=1e-5)


def test_standby_killed_while_taking_over(tmp_path, reference, caplog):
    """The standby is stopped (SIGSTOP), rank 1 SIGKILLed; once the driver has taken the
    standby over (its join waits on it), the standby is SIGKILLed: the recovery fails in its
    join and runs again, with a new process in rank 1's place."""
    caplog.set_level(logging.INFO, logger="rayhybrid")
    run_dir = tmp_path / "run"
    thread, result = in_background(["+topology=dp2", *COMMON, f"train.steps={STEPS}"], run_dir)
    when_step(run_dir, 3)
    (standby,) = warm_standbys().values()
    os.kill(standby, signal.SIGSTOP)
    killed = signal_rank(run_dir, 1, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not any("taken over by warm standby" in r.getMessage() for r in list(caplog.records)):
        assert time.monotonic() < deadline, "the standby was never taken over"
        time.sleep(0.01)
    os.kill(standby, signal.SIGKILL)
    summary = finished(thread, result)
    assert summary["restarts"] == 2
    assert "in the recovery" in summary["recoveries"][1]["cause"]
    assert pids(run_dir)[1] not in (killed, standby)
    assert losses(run_dir) == pytest.approx(reference, rel=1e-5)


@ray.remote(num_cpus=0)
class Rank:
    def gpus(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]


def test_standby_takes_the_gpu_ray_frees_in_the_bundle():
    """A stage's bundle of 2 GPUs (Ray's ids; none exists here), each held by a rank; one rank
    is killed: the standby that takes its place reports the GPU Ray freed in the bundle as its
    own, and picks its device among the node's GPUs by it, CUDA untouched (`placement`)."""
    reservation = Reservation(ReplicaShape(pp=1, tp=2, use_gpu=True, cpus_per_rank=0.5), 1)
    assert reservation.reserve(1, 60) == [0]
    pool = Standbys(ray.remote(concurrency_groups={CONTROL: 1})(adoptable(TrainWorker)), 1)
    try:
        ranks = [Rank.options(num_gpus=1, scheduling_strategy=reservation.strategy(0, i)).remote() for i in range(2)]
        held = [ray.get(r.gpus.remote(), timeout=60) for r in ranks]
        assert sorted(held) == [["0"], ["1"]]
        ray.kill(ranks[1], no_restart=True)
        node = reservation.node_of(0, 1)
        for _ in range(2):  # standbys start from the second training call on
            pool.tick(lambda: (load_config(["cluster.use_gpu=false"]), None, [node]))
        (standby,) = pool.pool[node]
        ray.get(standby.probe, timeout=120)  # warm
        taken = pool.take_for(reservation, 0, [1])
        assert list(taken) == [1]
        seen = ray.get(taken[1].placement.remote(("0", "1")), timeout=60)
        assert seen["gpu_ids"] == held[1]
        assert seen["device"] == f"cuda:{held[1][0]}" and seen["cuda_visible_devices"] == "0,1"
        assert seen["cuda_initialized"] is False
        ray.kill(taken[1], no_restart=True)
    finally:
        pool.stop()
        reservation.release()
