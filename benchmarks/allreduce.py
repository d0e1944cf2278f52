"""Latency and bandwidth of the process group's all-reduce between the ranks torchrun starts
(gloo on CPU, NCCL on GPUs): the communication cost behind the scaling figures.

    torchrun --standalone --nproc-per-node 2 benchmarks/allreduce.py

Rank 0 prints one JSON object: {"backend", "world_size", "rows": [{"bytes", "ms", "mb_per_s"}]}
(median of 20 calls after 3 warm-up calls per size).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import statistics
import time

import torch
import torch.distributed as dist

SIZES = (4 << 10, 256 << 10, 4 << 20, 64 << 20)


def main() -> None:
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rows = []
    for size in SIZES:
        x = torch.ones(size // 4, device="cuda" if cuda else "cpu")
        times = []
        for i in range(23):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        rows.append({"bytes": size, "ms": ms, "mb_per_s": size / 2**20 / (ms / 1e3)})
    if dist.get_rank() == 0:
        print(
            json.dumps({"backend": dist.get_backend(), "world_size": dist.get_world_size(), "rows": rows}), flush=True
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
