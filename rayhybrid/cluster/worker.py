"""The worker actor: one per rank. It owns its device, joins the process group and runs
`Trainer` steps on request. Ray code stays here; the training code never sees Ray."""

from __future__ import annotations

import logging
import os
import socket
import warnings
from dataclasses import dataclass

import ray

from rayhybrid.config.schema import Config


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    node_id: str
    ip: str
    pid: int
    gpu_ids: tuple[str, ...]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class TrainWorker:
    """Constructed by `WorkerGroup` through `ray.remote(...).options(...)` inside a replica's
    placement group bundle (bundle index = pipeline stage)."""

    def __init__(self, cfg: Config, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.trainer = None
        os.environ.setdefault("OMP_NUM_THREADS", str(cfg.cluster.torch_threads))
        # DTensor warns on every step that a 2-D norm reduction takes two all-reduces, and
        # FSDP2/replicate that a stage's output is a view (nothing here modifies it in place).
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    def info(self) -> WorkerInfo:
        ctx = ray.get_runtime_context()
        return WorkerInfo(
            rank=self.rank,
            node_id=ctx.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            gpu_ids=tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", [])),
        )

    def free_port(self) -> int:
        return free_port()

    def setup(self, master_addr: str, master_port: int, visible_gpus: tuple[str, ...] = ()) -> dict:
        """Join the process group and build this rank's part of the model.

        `visible_gpus`: every GPU the ranks on this node hold; each worker sees all of them
        (so NCCL can use peer-to-peer links) and picks its own by position.
        """
        import torch

        from rayhybrid.parallel.mesh import init_process_group
        from rayhybrid.trainer.loop import Trainer

        torch.set_num_threads(self.cfg.cluster.torch_threads)
        own = self.info().gpu_ids
        if own:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus or own)
            device = torch.device("cuda", list(visible_gpus or own).index(own[0]))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        init_process_group(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            device=device,
        )
        self.trainer = Trainer(self.cfg, rank=self.rank, device=device)
        return self.trainer.describe()

    def save(self, root: str, keep: int) -> dict:
        return self.trainer.save_checkpoint(root, keep)

    def load(self, path: str, meta: dict) -> int:
        self.trainer.load_checkpoint(path, meta)
        return self.trainer.step

    def train(self, steps: int = 1) -> list[dict]:
        return [self.trainer.train_step() for _ in range(steps)]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
