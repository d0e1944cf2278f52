"""Backend choice: NCCL when the worker holds a CUDA device, gloo on CPU (never configured)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

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
