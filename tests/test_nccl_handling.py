"""NCCL's error handling and the fault.nccl_like test mode, without Ray or a GPU: the environment
set before an NCCL group forms, the abort a no-op on gloo, and a failed collective recorded
instead of raised until the host syncs (rayhybrid/parallel/abort.py,
rayhybrid/faults/async_collectives.py). tests/test_vote.py runs them in a whole run."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from rayhybrid.faults import async_collectives
from rayhybrid.parallel import abort, mesh


@pytest.fixture
def no_handling_env(monkeypatch):
    monkeypatch.delenv(abort.ERROR_HANDLING_ENV, raising=False)


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
