"""Process group, backend choice and the named ("dp", "pp", "tp") device mesh."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "pp", "tp")


def select_backend(device: torch.device) -> str:
    """NCCL for a CUDA device, gloo otherwise: chosen, never configured by hand."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    *, rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device, timeout_s: float = 300
) -> None:
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend=select_backend(device),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def build_mesh(dp: int, pp: int, tp: int, device: torch.device) -> DeviceMesh:
    """The one mesh every sub-group comes from; rank order is tp fastest, dp outermost."""
    return init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=MESH_DIMS)


def forget_meshes() -> None:
    """After `destroy_process_group`: drop the references that device meshes (each keeps its
    groups in a registry) and DTensor's sharding caches (which keep meshes) still hold to the
    destroyed groups, so their connections close; a peer blocked on this rank then fails at
    once instead of waiting for the collective's timeout. The scan is short when the objects
    made by imports were frozen out of the collector (`gc.freeze`, see cluster/worker.py)."""
    import gc

    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:
            getattr(obj, "_pg_registry", {}).clear()
