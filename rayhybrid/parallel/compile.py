"""`train.compile`: each transformer block compiled on its own (regional compilation), and the
compiled artifacts kept where the next process on the node finds them.

    compile_blocks(blocks)   # after the TP plan and activation checkpointing, before FSDP2

A block's `forward` becomes `torch.compile(block.forward)`, in place (a `CheckpointedBlock`'s
`block_forward`, so that activation checkpointing recomputes the compiled code from outside it:
torch 2.13 could not trace the checkpoint around DTensor plans, "expected all
tensors_saved_with_vc_check to be Tensors ... DeviceMesh"). Its parameters keep their names
(checkpoints, the optimizer and the Hugging Face adapter read them by name), and the hooks of
the module (FSDP2's all-gather and reshard, added after) run around the compiled code as they
do around a block torchtitan compiles. What the block holds, float8 linears and DTensor plans
included, is traced with it. The blocks of a stage share one graph
(dynamo treats the block's parameters as inputs), so a stage compiles once, not once a block.

Inductor's FX graph cache and AOTAutograd cache live in one directory per node
(`cache_dir`): a replaced rank, a resized run and the next tune trial on the node load the
kernels instead of compiling them again (dynamo's tracing still runs, a second or so a graph).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil

import torch
from torch import nn

from rayhybrid.errors import ConfigError

log = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor keeps its caches (its FX graph cache, the AOTAutograd cache, generated code).
rayhybrid's compiled blocks use `<it>/rayhybrid`, or `<tmp>/torchinductor_<user>/rayhybrid`
when it is unset: per node, and outliving the process."""

COMPILERS = ("c++", "g++", "clang++")


@functools.cache
def cache_dir() -> str:
    """The node's compile cache for rayhybrid (`CACHE_ENV`), set for this process's inductor,
    with its caches on (torch's defaults, said here so an environment that turned them off does
    not make every restart compile again).

    Compiled blocks keep the tensors they save for backward (`donated_buffer` off): the
    zero-bubble schedules compute input gradients with `retain_graph=True` and weight gradients
    after, and torch refuses a donating backward there. Every rayhybrid run compiles so, and
    its artifacts live in their own folder: torch 2.13's AOTAutograd cache does not tell a
    donating backward from one that keeps its buffers, and one compiled the other way (by
    another program sharing inductor's folder) gave a zero-bubble run wrong weight gradients,
    silently."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    torch._functorch.config.donated_buffer = False
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    root = os.environ.get(CACHE_ENV) or default_cache_dir()
    os.environ[CACHE_ENV] = where = os.path.join(root, "rayhybrid")
    return where


def check_compiler(device: torch.device) -> None:
    """Inductor's CPU backend builds C++: without a compiler the first step would fail deep in
    inductor, so say it here, in one line."""
    if device.type != "cpu":
        return
    wanted = os.environ.get("CXX")
    if wanted:  # inductor builds with $CXX when it is set: that one must be there
        if shutil.which(wanted):
            return
        raise ConfigError(
            "train.compile", f"$CXX={wanted} is not found on this node; fix or unset CXX, or set train.compile=false"
        )
    if any(shutil.which(c) for c in COMPILERS):
        return
    raise ConfigError(
        "train.compile",
        "inductor's CPU backend needs a C++ compiler (g++ or clang++, or $CXX) on every node; "
        "install one or set train.compile=false",
    )


ZERO_BUBBLE_TORCH = (2, 13)
"""The first torch whose zero-bubble schedules split a compiled block's backward: 2.11 and 2.12
read the autograd node's `_input_metadata`, which a compiled block's node does not have."""


def check_compile(compile: bool, schedule: str, pp: int) -> None:
    """train.compile that this torch cannot run with the pipeline schedule: one line, before
    anything is built (`scripts/check_torch.sh` found it on torch 2.11 and 2.12)."""
    from rayhybrid.config.topology import SCHEDULE_TABLE

    if not compile or pp <= 1 or not SCHEDULE_TABLE[schedule].zero_bubble:
        return
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if version < ZERO_BUBBLE_TORCH:
        raise ConfigError(
            "train.compile",
            f"topology.schedule={schedule} splits the backward, which torch {torch.__version__} cannot do for "
            "compiled blocks (torch 2.13 can); choose another topology.schedule (1f1b, interleaved_1f1b), "
            "train.compile=false, or torch 2.13",
        )


def block_device(block: nn.Module) -> torch.device:
    param = next(block.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class Waited(torch.autograd.Function):
    """An `AsyncCollectiveTensor` as the plain tensor it wraps (waited for, no copy), its
    gradient passed through unchanged.

    A DTensor plan's collective in eager code hands its result on lazily, wrapped (the token
    embedding's all-reduce, through `to_local()`): an eager operator on it waits and returns a
    plain tensor, but a compiled block taking it as input traces it as a tensor subclass, and
    torch 2.13 then sends the block's input gradient, a plain tensor, past `to_local()`'s
    backward into the all-reduce's, which wants a DTensor ("'Tensor' object has no attribute
    '_local_tensor'"). Seen with Llama under tp: its first block reads the embedding's output
    directly (GPT adds its position embedding first, in eager code)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def compiled(fn):
    """`torch.compile(fn)`, its tensor arguments waited for (`Waited`) in eager code first."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    inner = torch.compile(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        args = tuple(Waited.apply(a) if isinstance(a, AsyncCollectiveTensor) else a for a in args)
        return inner(*args, **kwargs)

    return call


def compile_blocks(blocks: list[nn.Module]) -> None:
    """Compile each block's forward on its own, in place (see the module's docstring)."""
    if not blocks:
        return
    check_compiler(block_device(blocks[0]))
    where = cache_dir()
    for block in blocks:
        if hasattr(block, "block_forward"):  # a CheckpointedBlock: its recomputation stays outside
            block.block_forward = compiled(block.block_forward)
        else:
            block.forward = compiled(block.forward)
    log.debug("compiling %d blocks; compile cache %s", len(blocks), where)
