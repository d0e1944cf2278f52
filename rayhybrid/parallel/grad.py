"""Global gradient norm and clipping across tensor, data and pipeline parallel ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    params: list[torch.nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
    uncounted: list[torch.nn.Parameter] = (),
    waiting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """Clip to `max_norm` (0 = only measure) and return the global L2 norm of all gradients.

    DTensor gradients (TP- or FSDP-sharded) reduce over their own mesh via `full_tensor()`;
    plain gradients are identical on every tp rank and count once. Stages hold disjoint
    parameters, so squared norms add over the pp group; `uncounted` (copies of a parameter
    another stage holds: rayhybrid/parallel/tied.py) are clipped but not counted. `waiting()`
    is entered around the pp all-reduce (the trainer times it: its MFU split).
    """
    grads = [p.grad for p in params if p.grad is not None]
    skip = {id(p.grad) for p in uncounted}
    counted = [g for g in grads if id(g) not in skip]
    dtensor = [g for g in counted if isinstance(g, DTensor)]
    plain = [g for g in counted if not isinstance(g, DTensor)]
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    by_mesh: dict[object, list[DTensor]] = {}
    for g in dtensor:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    for group in by_mesh.values():
        total_sq += torch.nn.utils.get_total_norm(group).full_tensor().float() ** 2
    if plain:
        total_sq += torch.nn.utils.get_total_norm(plain).float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        with waiting():
            dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        # torch's clip_grads_with_norm_ cannot mix plain tensors and DTensors on different
        # meshes in one foreach call, so scale the local shards with the global coefficient.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(local, coef.to(local[0].dtype))
    return total
