"""Apply tensor parallelism, activation checkpointing and data parallelism to a GPT stage.

Order as in torchtitan: TP first (DTensor plans), then activation checkpointing, then each
block compiled on its own (train.compile), then data parallelism over the dp mesh. Pipeline splitting happens before and calls this per stage.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from rayhybrid.models.gpt.model import GPT
from rayhybrid.models.layers import checkpoint_and_shard
from rayhybrid.parallel.float8 import colwise_style, replicated_input_style, rowwise_style


def tp_plan(model: GPT, *, loss_parallel: bool) -> dict[str, object]:
    """Megatron-style split: q/k/v and the first MLP layer column-wise (heads and hidden units
    per rank), the attention and MLP output projections row-wise (one all-reduce each), the
    token embedding vocab-parallel, and the output projection vocab-parallel. With
    `loss_parallel` the logits stay sharded over the vocabulary into the loss. A block's float8
    linears (train.float8) take torchao's float8 styles (rayhybrid/parallel/float8.py)."""
    plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    for name in model.layers:
        p = f"layers.{name}."
        # The attention input becomes one replicated DTensor shared by q, k and v, so their
        # input gradients add up locally and cost one all-reduce in backward instead of three.
        plan[p + "attn"] = replicated_input_style(model, p + "attn")
        for linear in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1"):
            plan[p + linear] = colwise_style(model, p + linear)
        for linear in ("attn.wo", "mlp.w2"):
            plan[p + linear] = rowwise_style(model, p + linear)
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    return plan


def parallelize_gpt(
    model: GPT,
    *,
    tp_mesh: DeviceMesh | None,
    dp_mesh: DeviceMesh | None,
    dp_shard: bool,
    activation_checkpointing: bool,
    loss_parallel: bool,
    reshard_after_forward: bool = True,
    compile: bool = False,
    offload_activations: bool = False,
) -> GPT:
    if tp_mesh is not None and tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, tp_plan(model, loss_parallel=loss_parallel))
    return checkpoint_and_shard(
        model,
        list(model.layers.values()),
        dp_mesh=dp_mesh,
        dp_shard=dp_shard,
        activation_checkpointing=activation_checkpointing,
        reshard_after_forward=reshard_after_forward,
        compile=compile,
        offload_activations=offload_activations,
    )
