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
    """After `destroy_process_group`: forget every device mesh of the world just left.

    Two kinds of references outlive the world. Device meshes keep their groups in a registry,
    so the groups' connections stay open; clearing it closes them, and a peer blocked on this
    rank fails at once instead of waiting for the collective's timeout. And DTensor caches
    sharding decisions keyed by mesh, where two meshes are equal when their shape and dimension
    names are (group names do not count): a worker that later joins a world of the same shape
    under another rank would get back a cached mesh whose groups are the old world's, and fail
    with "Could not resolve the process group registered under the name N". The scan is short
    when the objects made by imports were frozen out of the collector (`gc.freeze`, see
    cluster/worker.py)."""
    import gc

    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:
            getattr(obj, "_pg_registry", {}).clear()
