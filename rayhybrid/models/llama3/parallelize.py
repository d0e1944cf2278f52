"""Tensor parallelism, activation checkpointing, compiled blocks (train.compile) and data
parallelism for a Llama stage.

The DTensor plan is torchtitan's Llama plan without sequence parallelism (norms replicated),
the same split as rayhybrid's GPT: q/k/v (heads and KV heads per rank) and the MLP's w1 and w3
column-wise, wo and w2 row-wise (one all-reduce each), the token embedding vocab-parallel, the
output vocab-parallel (logits left sharded into the loss with `loss_parallel`).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from rayhybrid.models.layers import checkpoint_and_shard
from rayhybrid.models.llama3.model import Llama
from rayhybrid.parallel.float8 import colwise_style, replicated_input_style, rowwise_style


def tp_plan(model: Llama, *, loss_parallel: bool) -> dict[str, object]:
    plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    for name in model.layers:
        p = f"layers.{name}."
        # One replicated input DTensor per sub-layer, shared by q/k/v (and by w1/w3), so their
        # input gradients add up locally and cost one all-reduce in backward.
        for sub in ("attention", "feed_forward"):
            plan[p + sub] = replicated_input_style(model, p + sub)
        for linear in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[p + linear] = colwise_style(model, p + linear)
        for linear in ("attention.wo", "feed_forward.w2"):
            plan[p + linear] = rowwise_style(model, p + linear)
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    return plan


def parallelize_llama(
    model: Llama,
    *,
    tp_mesh: DeviceMesh | None,
    dp_mesh: DeviceMesh | None,
    dp_shard: bool,
    activation_checkpointing: bool,
    loss_parallel: bool,
    reshard_after_forward: bool = True,
    compile: bool = False,
    offload_activations: bool = False,
) -> Llama:
    tied = model.settings.tie_embeddings and model.tok_embeddings is not None and model.output is not None
    if tp_mesh is not None and tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, tp_plan(model, loss_parallel=loss_parallel))
        if tied:
            # Both are Shard(0) over the vocabulary rows: one DTensor serves both again.
            model.tie()
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
