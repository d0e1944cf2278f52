"""Data parallelism over the dp mesh: FSDP2 `fully_shard` (HSDP on a 2-D mesh) or FSDP2-style
`replicate`."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def apply_data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    shard: bool,
    blocks: list[nn.Module],
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard (`shard=True`: each block, then the root, so parameters are gathered block by
    block) or replicate the module; gradients are averaged over dp either way. A 2-D
    `dp_mesh` ("dp_replicate", "dp_shard": `topology.dp_shard=N`, see parallel/mesh.py
    `split_dp`) with `shard=True` is HSDP: sharded over the second dimension, replicated over
    the first."""
    if shard:
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    else:
        replicate(model, mesh=dp_mesh)
    return model
