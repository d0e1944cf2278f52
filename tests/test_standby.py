"""Warm standby workers (fault.standby, rayhybrid/cluster/standby.py): a rank SIGKILLed from
outside is replaced by a standby's process, started before the kill, and the recovery's init
phase is a fraction of a cold start's; a standby killed from outside is replaced without
interrupting the run; a standby killed as it takes a rank over still ends in a recovered run.
Every run ends with an uninterrupted run's losses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from test_recovery import in_background, losses, signal_rank, when_step

import rayhybrid
from rayhybrid.cluster.group import WorkerGroup
from rayhybrid.cluster.placement import ReplicaShape
from rayhybrid.cluster.reservation import Reservation
from rayhybrid.cluster.spawn import standby_count
from rayhybrid.cluster.standby import MAX_FAILED_STARTS, NAME_PREFIX, Standbys, adoptable
from rayhybrid.cluster.state import GroupState
from rayhybrid.cluster.worker import CONTROL, TrainWorker
from rayhybrid.config.compose import replace
from rayhybrid.preflight import load_config
from rayhybrid.tune.space import trial_config
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


def test_standby_killed_while_taking_over(tmp_path, reference, monkeypatch):
    """The standby that takes rank 1's place (rank 1 SIGKILLed) is SIGKILLed as soon as it is
    taken: the recovery fails in its join and runs again, with a new process in rank 1's place."""
    take, gone = Standbys.take, []

    def take_and_kill(self, *args, **kwargs):
        taken = take(self, *args, **kwargs)
        for actor in taken:
            gone.append(ray.get(actor.ping.remote(), timeout=30))
            os.kill(gone[-1], signal.SIGKILL)
        return taken

    monkeypatch.setattr(Standbys, "take", take_and_kill)
    run_dir = tmp_path / "run"
    thread, result = in_background(["+topology=dp2", *COMMON, f"train.steps={STEPS}"], run_dir)
    when_step(run_dir, 3)
    warm_standbys()
    killed = signal_rank(run_dir, 1, signal.SIGKILL)
    summary = finished(thread, result)
    assert len(gone) == 1 and summary["restarts"] == 2
    assert "in the recovery" in summary["recoveries"][1]["cause"]
    assert pids(run_dir)[1] not in (killed, *gone)
    assert losses(run_dir) == pytest.approx(reference, rel=1e-5)


def test_stopped_standby_is_not_taken(tmp_path, reference):
    """A standby stopped from outside (SIGSTOP) does not answer its ping: rank 1 SIGKILLed is
    replaced by a new process, not by the stopped standby (whose join would wait
    start_timeout_s, 300 s), and the recovery takes seconds."""
    run_dir = tmp_path / "run"
    thread, result = in_background(["+topology=dp2", *COMMON, f"train.steps={STEPS}"], run_dir)
    when_step(run_dir, 3)
    (standby,) = warm_standbys().values()
    os.kill(standby, signal.SIGSTOP)
    try:
        killed = signal_rank(run_dir, 1, signal.SIGKILL)
        summary = finished(thread, result)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(standby, signal.SIGKILL)
    (recovery,) = summary["recoveries"]
    assert pids(run_dir)[1] not in (killed, standby)
    assert recovery["total_s"] < 60, recovery
    assert losses(run_dir) == pytest.approx(reference, rel=1e-5)


@ray.remote(num_cpus=0)
class Rank:
    def gpus(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]


def test_standby_takes_the_gpu_ray_frees_in_the_bundle():
    """A stage's bundle of 2 GPUs (Ray's ids; none exists here), each held by a rank; both ranks
    are killed, one after the other, and each is taken over by a standby: each reports the GPU
    its rank held (leased in the bundle: Ray's books show it held), and picks its device among
    the node's GPUs by it, CUDA untouched (`placement`). With both leased, another actor of
    the bundle asking for a GPU waits; it gets one only when a standby holding one ends."""
    reservation = Reservation(ReplicaShape(pp=1, tp=2, use_gpu=True, cpus_per_rank=0.5), 1)
    assert reservation.reserve(1, 60) == [0]
    pool = Standbys(ray.remote(concurrency_groups={CONTROL: 1})(adoptable(TrainWorker)), 2)
    try:
        ranks = [Rank.options(num_gpus=1, scheduling_strategy=reservation.strategy(0, i)).remote() for i in range(2)]
        held = [ray.get(r.gpus.remote(), timeout=60) for r in ranks]
        assert sorted(held) == [["0"], ["1"]]
        node = reservation.node_of(0, 1)
        for _ in range(2):  # standbys start from the second training call on
            pool.tick([node], lambda: (load_config(["cluster.use_gpu=false"]), None))
        ray.get([s.warm for s in pool.pool[node]], timeout=120)
        standbys = {}
        for local in (1, 0):
            ray.kill(ranks[local], no_restart=True)
            taken = pool.take_for(reservation, 0, [local])
            assert list(taken) == [local]
            standbys[local] = taken[local]
            seen = ray.get(taken[local].placement.remote(("0", "1")), timeout=60)
            assert seen["gpu_ids"] == held[local]
            assert seen["device"] == f"cuda:{held[local][0]}" and seen["cuda_visible_devices"] == "0,1"
            assert seen["cuda_initialized"] is False
        late = Rank.options(num_gpus=1, scheduling_strategy=reservation.strategy(0, 0)).remote()
        answer = late.gpus.remote()
        assert not ray.wait([answer], timeout=1.0)[0]  # both GPUs held by the standbys' leases
        ray.kill(standbys[1], no_restart=True)  # its lease ends with it
        assert ray.get(answer, timeout=60) == held[1]
        for actor in (late, standbys[0]):
            ray.kill(actor, no_restart=True)
    finally:
        pool.stop()
        reservation.release()


def light():
    """A standby's calls, without the trainer's imports (a local class: cloudpickle ships it)."""

    class Light:
        def __init__(self, cfg, rank: int, world_size: int) -> None:
            pass

        def warm(self) -> int:
            return os.getpid()

        def ping(self) -> int:
            return os.getpid()

    return ray.remote(Light)


def dies(actor, within_s: float) -> bool:
    """Whether `actor` stops answering within `within_s`. `ray.kill` is asynchronous: it goes
    through the GCS to the actor's node, while a call goes straight to the actor, so a call made
    just after the kill may still be answered."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        time.sleep(0.1)
    return False


def test_standbys_leave_nodes_without_ranks_and_a_bad_node_turns_off_its_own():
    """Standbys on a node that no longer runs ranks are stopped at the next tick; a node where
    every standby dies before it is ready (here: one that does not exist) gets none after
    MAX_FAILED_STARTS of them, while the other nodes keep theirs."""
    node, bad = ray.get_runtime_context().get_node_id(), "ab" * 28
    pool = Standbys(light(), 1)
    context = lambda: (None, None)
    try:
        deadline = time.monotonic() + 120
        while bad not in pool.off_nodes:
            assert time.monotonic() < deadline, pool.pool
            pool.tick([node, bad], context)
            time.sleep(0.05)
        assert pool.per_node == 1 and not pool.pool[bad]
        (standby,) = pool.pool[node]
        assert ray.get(standby.warm, timeout=60) > 0
        pool.tick([], context)  # the run left the node
        assert not pool.pool.get(node)
        assert dies(standby.actor, within_s=60)
    finally:
        pool.stop()
    assert MAX_FAILED_STARTS == 3


def test_an_error_in_the_upkeep_turns_the_standbys_off(caplog):
    """An error while standbys are started (here the code upload's) does not reach the run: one
    warning, and no more standbys."""
    pool = Standbys(light(), 1)

    def context():
        raise OSError("upload failed")

    for _ in range(3):
        pool.tick(["n"], context)
    assert pool.per_node == 0
    assert [r.getMessage() for r in caplog.records if "turned off" in r.getMessage()] == [
        "warm standbys turned off after an error in their upkeep: OSError: upload failed"
    ]


def test_a_step_is_issued_before_the_standby_upkeep():
    """`WorkerGroup.train` issues the step's calls, then tends the standbys (which may start
    processes and upload code), then waits for the step."""
    order = []
    group = WorkerGroup.__new__(WorkerGroup)
    group._state = GroupState(load_config([]))
    group.spawner = SimpleNamespace(tick=lambda cfg, infos: order.append("tick"))
    group._on_every_rank = lambda *args: order.append("calls") or []
    group.remote_calls = SimpleNamespace(get=lambda *args, **kwargs: order.append("wait") or [])
    with contextlib.suppress(Exception):
        group.train()
    assert order == ["calls", "tick", "wait"]


def test_runs_that_replace_no_rank_start_no_standbys():
    """Tuning trials (their steps are measured) and runs with fault.max_restarts=0 (unless they
    may grow) get no standbys; an empty pool looks nothing up (no placement-group table)."""
    cfg = load_config([])
    assert standby_count(cfg) == 1
    assert standby_count(replace(cfg, fault={"max_restarts": 0})) == 0
    assert standby_count(replace(cfg, fault={"max_restarts": 0}, elastic={"enabled": True})) == 1
    point = {"micro_batch_size": 1, "num_microbatches": 1, "activation_checkpointing": False}
    assert trial_config(cfg, point).fault.standby == 0
    no_lookup = SimpleNamespace(shape=None, node_of=None, strategy=None)  # any use would raise
    assert Standbys(None, 1).take_for(no_lookup, 0, [0, 1]) == {}
