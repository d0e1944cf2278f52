"""Backend choice: NCCL when the worker holds a CUDA device, gloo on CPU (never configured)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed as dist

from rayhybrid.errors import TESTED_TORCH
from rayhybrid.parallel.mesh import init_process_group, select_backend
from tests.distributed import RankError, backend_and_sum, fail_on_rank, free_port, run_ranks


def test_select_backend_cuda_is_nccl():
    # Pure: a device object needs no CUDA.
    assert select_backend(torch.device("cuda")) == "nccl"
    assert select_backend(torch.device("cuda", 1)) == "nccl"


def test_select_backend_cpu_is_gloo():
    assert select_backend(torch.device("cpu")) == "gloo"


def test_cpu_group_uses_gloo():
    assert run_ranks(backend_and_sum, 2) == [("gloo", 3.0), ("gloo", 3.0)]


@pytest.mark.parametrize("how,message", [("raise", "breaks on purpose"), ("exit", r"\{1: 3\}")])
def test_failing_rank_is_reported_not_hung(how, message):
    # The healthy rank waits in an all-reduce that never completes; the harness must end it.
    start = time.monotonic()
    with pytest.raises(RankError, match=message):
        run_ranks(fail_on_rank, 2, 1, how, timeout=120)
    assert time.monotonic() - start < 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_single_rank_group():
    device = torch.device("cuda", 0)
    assert not dist.is_initialized()
    init_process_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device=device)
    try:
        assert dist.get_backend() == "nccl"
        t = torch.ones(4, device=device)
        dist.all_reduce(t)
        torch.cuda.synchronize(device)
        assert t.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


def test_torch_internals_that_moved_skip_their_feature_with_one_warning(monkeypatch, caplog):
    """mesh.py's uses of torch internals (c10d's default timeouts and `_world`, DTensor's caches)
    check that each is there: in a torch where one moved, the feature is skipped with one
    warning naming it and what is lost, and nothing is assigned that torch would not read."""
    from types import SimpleNamespace

    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.tensor import _redistribute

    from rayhybrid.parallel import mesh

    monkeypatch.setattr(mesh, "_warned", set())
    caplog.set_level(logging.WARNING, logger="rayhybrid")
    monkeypatch.delattr(c10d, "default_pg_nccl_timeout")
    default = c10d.default_pg_timeout
    for _ in range(2):
        with mesh.joining(60.0, timeout_s=1.0):
            assert c10d.default_pg_timeout == default  # not shortened: it could not be put back per group
    with monkeypatch.context() as patch:
        patch.setattr(c10d, "_world", SimpleNamespace(pg_map={}))  # group_count renamed
        mesh.forget_group_names()
        assert not hasattr(c10d._world, "group_count")
    monkeypatch.delattr(_redistribute, "_gen_transform_infos")
    cleared = []
    monkeypatch.setattr(_redistribute, "clear_redistribute_planner_cache", lambda: cleared.append(1))
    mesh.forget_meshes()
    assert cleared == [1]  # the caches still there are cleared
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3 and all("\n" not in w and TESTED_TORCH in w for w in warnings), warnings
    join, names, caches = warnings
    assert "torch's default timeout" in join and f"{mesh.C10D}.default_pg_nccl_timeout" in join
    assert "name the next world's groups" in names and f"{mesh.C10D}._world.group_count" in names
    assert "cached mesh" in caches and "torch.distributed.tensor._redistribute._gen_transform_infos" in caches
