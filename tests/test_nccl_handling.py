"""NCCL's error handling and the fault.nccl_like test mode, without a Ray cluster or a GPU: the
environment set before an NCCL group forms, the abort a no-op on gloo, once per world and never
beside the world's destruction, a worker that aborts only after a failed call, and a failed
collective recorded instead of raised until the host syncs (rayhybrid/parallel/abort.py,
rayhybrid/cluster/worker.py, rayhybrid/faults/async_collectives.py). tests/test_vote.py runs
them in a whole run."""

from __future__ import annotations

import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rayhybrid.faults import async_collectives
from rayhybrid.parallel import abort, mesh


def clear_handling_env(monkeypatch) -> None:
    """The variable absent until `monkeypatch` undoes, and then as it was before: set first, so
    that monkeypatch records it and removes what the test set (a bare delenv of an absent
    variable records nothing, and the "2" the test sets would stay for every later test)."""
    monkeypatch.setenv(abort.ERROR_HANDLING_ENV, "unset by the test")
    monkeypatch.delenv(abort.ERROR_HANDLING_ENV)


@pytest.fixture
def no_handling_env(monkeypatch):
    clear_handling_env(monkeypatch)


def test_the_error_handling_tests_leave_the_environment_as_they_found_it():
    before = dict(os.environ)
    with pytest.MonkeyPatch.context() as monkeypatch:
        clear_handling_env(monkeypatch)
        abort.nccl_error_handling()
        assert os.environ[abort.ERROR_HANDLING_ENV] == "2"
    assert dict(os.environ) == before


def test_an_nccl_group_forms_with_clean_up_only_error_handling(monkeypatch, no_handling_env):
    """Before the NCCL group forms the environment says: abort the communicator, keep the process
    (torch's default, 3, would tear a survivor down with the state it keeps)."""
    seen = {}

    def fake_init(**kwargs):
        seen["backend"] = kwargs["backend"]
        seen["env"] = abort.os.environ.get(abort.ERROR_HANDLING_ENV)

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    mesh.init_process_group(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, device=torch.device("cuda", 0)
    )
    assert seen == {"backend": "nccl", "env": "2"}


def test_a_gloo_group_leaves_the_environment_alone(monkeypatch, no_handling_env):
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: None)
    mesh.init_process_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, device=torch.device("cpu"))
    assert abort.ERROR_HANDLING_ENV not in abort.os.environ


def test_a_users_error_handling_is_kept_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(abort.ERROR_HANDLING_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="rayhybrid.parallel.abort"):
        abort.nccl_error_handling()
    assert abort.os.environ[abort.ERROR_HANDLING_ENV] == "1"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in caplog.text and "peer healing" in caplog.text


@pytest.fixture
def gloo_world():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    async_collectives.uninstall()
    dist.destroy_process_group()


def test_abort_is_a_no_op_on_gloo(gloo_world):
    assert abort.abort_collectives() is False
    t = torch.ones(2)
    dist.all_reduce(t)  # the group still works
    assert t.tolist() == [1.0, 1.0]


def test_a_failed_collective_is_recorded_and_raised_at_the_next_host_sync(gloo_world, monkeypatch):
    """Installed, a collective that fails leaves its tensor as it was and the host goes on; the
    failure is raised by `host_sync`. Uninstalled, the originals are back."""

    def broken(tensor, *args, async_op=False, **kwargs):
        raise dist.DistBackendError("Connection closed by peer")

    original = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", broken)
    async_collectives.install()
    t = torch.full((3,), 2.0)
    assert dist.all_reduce(t) is None  # no exception here
    assert t.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(async_collectives.CollectiveFailed, match="all_reduce: Connection closed by peer"):
        async_collectives.host_sync()
    async_collectives.host_sync()  # raised once
    async_collectives.uninstall()
    assert dist.all_reduce is broken  # what was there before install
    monkeypatch.setattr(dist, "all_reduce", original)
    u = torch.ones(1)
    async_collectives.install()
    dist.all_reduce(u)  # a working collective is waited and complete
    assert u.tolist() == [1.0] and async_collectives.installed()


@pytest.fixture
def counted_aborts(monkeypatch):
    """`abort._abort_world` counted (it aborts an NCCL world; here a fake one, slow enough for two
    threads to meet), and the world formed afresh."""
    calls = []

    def fake_abort_world():
        calls.append(threading.get_ident())
        time.sleep(0.05)
        return True

    monkeypatch.setattr(abort, "_abort_world", fake_abort_world)
    abort.formed()
    yield calls
    abort.formed()


def test_a_world_is_aborted_once_by_either_thread_until_the_next_forms(counted_aborts):
    threads = [threading.Thread(target=abort.abort_collectives) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(counted_aborts) == 1  # the drain's and the failed call's abort met: one ran
    assert abort.abort_collectives() is False and len(counted_aborts) == 1
    abort.formed()  # a new world
    assert abort.abort_collectives() is True and len(counted_aborts) == 2


def test_leaving_waits_for_an_abort_in_progress_and_stops_later_ones(counted_aborts):
    aborting = threading.Thread(target=abort.abort_collectives)
    aborting.start()
    while not counted_aborts:  # the abort holds the lock
        time.sleep(0.001)
    abort.leaving()  # waits for it: no abort walks the groups while they are destroyed
    assert not aborting.is_alive()
    aborting.join()
    abort.formed()
    abort.leaving()
    assert abort.abort_collectives() is False and len(counted_aborts) == 1


class FakeTrainer:
    heal = True
    settled = True

    def __init__(self):
        self.feed = SimpleNamespace(close=lambda: None)

    def close_checkpoints(self):
        pass


def worker_with_a_trainer(monkeypatch):
    """A TrainWorker without Ray (its methods are plain ones) holding a fake trainer, and the
    number of aborts and keeps it makes."""
    from rayhybrid.cluster.worker import TrainWorker

    counts = {"abort": 0, "keep": 0}
    monkeypatch.setattr(abort, "abort_collectives", lambda: counts.__setitem__("abort", counts["abort"] + 1))
    worker = TrainWorker.__new__(TrainWorker)
    worker.rank, worker.trainer, worker.store = 0, FakeTrainer(), None
    worker.healer = SimpleNamespace(
        keep=lambda trainer, rank: counts.__setitem__("keep", counts["keep"] + 1), forget=lambda: None
    )
    return worker, counts


def test_a_worker_aborts_and_keeps_only_after_a_failed_call(monkeypatch):
    from rayhybrid.errors import RankFailed

    worker, counts = worker_with_a_trainer(monkeypatch)
    worker.reset()  # a clean leave (setup's rejoin, a resize, tune's reconfigure): healthy groups
    assert counts == {"abort": 0, "keep": 0}
    worker.trainer = FakeTrainer()
    worker.close()  # the end
    assert counts == {"abort": 0, "keep": 0}

    def broken():
        raise RuntimeError("a peer died")

    worker.trainer = FakeTrainer()
    with pytest.raises(RankFailed, match="a peer died"):
        worker._guarded(broken)
    assert counts == {"abort": 1, "keep": 1} and worker.trainer is None
