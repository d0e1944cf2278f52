"""Pieces the built-in models share (torch): a block that can checkpoint its activations,
initialisation by full parameter name, and the activation checkpointing, compiled blocks and data
parallelism that follow a model's tensor-parallel plan."""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rayhybrid.parallel.compile import compile_blocks
from rayhybrid.parallel.data_parallel import apply_data_parallel
from rayhybrid.parallel.offload import offload_blocks
from rayhybrid.parallel.tied import tied_copies


class CheckpointedBlock(nn.Module):
    """A transformer block whose `block_forward` is recomputed in backward (activation
    checkpointing) once `checkpoint_activations` is set."""

    checkpoint_activations = False

    def block_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.block_forward, x, use_reentrant=False)
        return self.block_forward(x)


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


def tied_names(module: nn.Module) -> dict[str, str]:
    """{name: the name it is stored under} for every parameter of a stage that is another's:
    the same tensor held twice (`shared_parameters`) or a copy kept on another pipeline stage
    (the stage's `tied_copies()`, see rayhybrid/parallel/tied.py). Checkpoints and Hugging Face
    imports read and write such a parameter once, under the other name."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return dict(shared_parameters(module)) | {
        name: source for name, source in tied_copies(module).items() if name in params
    }


def name_seed(seed: int, name: str) -> int:
    """A stable (process-independent) seed for a parameter: Python's hash() of str is salted."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_by_name(
    module: nn.Module,
    seed: int,
    n_layers: int,
    residual: tuple[str, ...],
    std: float = 0.02,
    aliases: dict[str, str] | None = None,
) -> None:
    """Every parameter from a generator seeded by (seed, its full name), so its value does not
    depend on which stage holds it and every topology starts from the same model: norms at one,
    biases at zero, matrices and embeddings normal(0, std), the residual output projections
    (names ending in `residual`) scaled by 1/sqrt(2 x n_layers) as in GPT-2. A parameter named
    in `aliases` starts as the one it names (a tied copy on another stage)."""
    aliases = aliases or {}
    for own, param in module.named_parameters():
        name = aliases.get(own, own)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            gen = torch.Generator().manual_seed(name_seed(seed, name))
            scale = std / math.sqrt(2 * n_layers) if name.endswith(residual) else std
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * scale
            param.copy_(values.to(param.device, param.dtype))


def checkpoint_and_shard(
    model: nn.Module,
    blocks: list[nn.Module],
    *,
    dp_mesh: DeviceMesh | None,
    dp_shard: bool,
    activation_checkpointing: bool,
    reshard_after_forward: bool,
    compile: bool = False,
    offload_activations: bool = False,
) -> nn.Module:
    """After the TP plan: activation checkpointing of every block, then (`compile`,
    train.compile) each block compiled on its own, then (`offload_activations`) what each
    block saves for backward kept in host memory (rayhybrid/parallel/offload.py), then data
    parallelism over the dp mesh (FSDP2 block by block, or replicate)."""
    if activation_checkpointing:
        for block in blocks:
            block.checkpoint_activations = True
    if compile:
        compile_blocks(blocks)
    if offload_activations:
        offload_blocks(blocks)
    if dp_mesh is not None and dp_mesh.size() > 1:
        apply_data_parallel(model, dp_mesh, shard=dp_shard, blocks=blocks, reshard_after_forward=reshard_after_forward)
    return model
