"""A module parallelised on the meta device, materialised with only this rank's shards.

    stage = spec.parallelize(stage_on_meta, ...)    # DTensor plans and FSDP2 work on meta
    materialise(stage, device, value)             # value(name, shape) -> the whole tensor

`to_empty` allocates each parameter's and buffer's local shard (a DTensor's local tensor: its
tp, and with FSDP2 its dp, slice); then, one tensor at a time, `value` gives the whole
(unsharded) tensor, `distribute_tensor(..., src_data_rank=None)` cuts this rank's slice of it
without any communication, and the slice is copied in. So a rank holds its shards plus at most
one whole tensor while it builds, and every rank's values are slices of the same whole model,
whatever the layout.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

log = logging.getLogger(__name__)

Value = Callable[[str, torch.Size], torch.Tensor]
"""The whole initial value of the parameter or buffer with this name and (global) shape."""


def shared_parameters(module: nn.Module) -> list[tuple[str, str]]:
    """(name, the earlier name of the same parameter) for every parameter held twice (an output
    tied to the token embedding)."""
    first: dict[int, str] = {}
    tied = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return tied


def retie(module: nn.Module, tied: list[tuple[str, str]]) -> None:
    """Make each (name, source) of `tied` one parameter again (`to_empty` may have given each
    name a tensor of its own)."""
    for name, source in tied:
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, module.get_parameter(source))


@torch.no_grad()
def materialise(module: nn.Module, device: torch.device, value: Value | None = None) -> nn.Module:
    """Allocate `module`'s local shards on `device` and fill them from `value` (see above),
    parameters then buffers, in their order; a tied parameter once. Without `value` they are
    left empty, for the caller to fill."""
    tied = shared_parameters(module)
    module.to_empty(device=device)  # may give each name its own tensor: ties undone
    retie(module, tied)
    if value is None:
        return module
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        fill(tensor, value(name, tensor.shape))
    return module


def fill(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's slice of `whole` into `tensor` (a DTensor: into its local shard). The
    slice is a view of `whole` where it sits (the CPU, for the built-in models), so the device
    receives the shard alone; `distribute_tensor` cuts it otherwise (see `_block`)."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(whole)
        return
    local = tensor.to_local()
    block = _block(tensor)
    if block is not None and block[0] == tuple(local.shape):
        shape, offset = block
        local.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        return
    whole = whole.to(local.device, tensor.dtype)  # the whole on the device while it is cut
    local.copy_(distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local())


def _block(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """This rank's shard of `tensor` as (shape, offset) in the whole, as DCP reads and writes
    it; None in a torch without that private helper (the shard is then cut by
    `distribute_tensor`, which holds up to about two more whole copies on the device while it
    cuts: one warning)."""
    global _warned
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as err:
        if not _warned:
            log.warning("the stages' shards are cut on the device, holding more memory while they build (%s)", err)
            _warned = True
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


_warned = False
