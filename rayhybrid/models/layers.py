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
from rayhybrid.parallel.materialise import shared_parameters
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


def initial_value(
    seed: int, name: str, shape: tuple[int, ...], *, n_layers: int, residual: tuple[str, ...], std: float = 0.02
) -> torch.Tensor:
    """The whole initial value (float32, on the CPU) of the parameter `name`, from a generator
    seeded by (seed, name), so it does not depend on which stage, or which rank's shard of it,
    holds it: norms at one, biases at zero, matrices and embeddings normal(0, std), the residual
    output projections (names ending in `residual`) scaled by 1/sqrt(2 x n_layers) as in GPT-2."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    scale = std / math.sqrt(2 * n_layers) if name.endswith(residual) else std
    return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(scale)  # in place: one whole tensor


@torch.no_grad()
def init_by_name(
    module: nn.Module,
    seed: int,
    n_layers: int,
    residual: tuple[str, ...],
    std: float = 0.02,
    aliases: dict[str, str] | None = None,
) -> None:
    """Every parameter of a materialised `module` set to its `initial_value`. A parameter named
    in `aliases` starts as the one it names (a tied copy on another stage)."""
    aliases = aliases or {}
    for own, param in module.named_parameters():
        name = aliases.get(own, own)
        values = initial_value(seed, name, param.shape, n_layers=n_layers, residual=residual, std=std)
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
