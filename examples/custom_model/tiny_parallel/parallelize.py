"""tiny_parallel's tensor-parallel plan, then activation checkpointing, then data parallelism.

The plan differs from the built-in models' where the parallel block allows it. The two output
projections (attention's wo and the MLP's w_out) are row-parallel but leave their results as
partial sums (`Partial`), the mixer adds the two partial sums, and one all-reduce makes the sum
whole: one forward all-reduce per block instead of two. The mixer's input (the shared norm's
output) becomes one replicated DTensor read by q, k, v and the MLP's w_in, so their input
gradients add up locally and cost one all-reduce in backward.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from rayhybrid.parallel.data_parallel import apply_data_parallel


def tp_plan(model, *, loss_parallel: bool) -> dict[str, object]:
    plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())  # vocab-parallel
        # pos_embeddings: replicated (a plain tensor on every tp rank).
    for i in model.layers:
        p = f"layers.{i}.mixer"
        plan[p] = PrepareModuleInputOutput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Replicate(),),
            output_layouts=(Partial(),),
            desired_output_layouts=(Replicate(),),
            use_local_output=True,
        )
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w_in"):
            plan[f"{p}.{name}"] = ColwiseParallel()  # heads / hidden units per rank
        for name in ("attn.wo", "mlp.w_out"):
            plan[f"{p}.{name}"] = RowwiseParallel(output_layouts=Partial(), use_local_output=False)
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    return plan


def parallelize_tiny(
    model,
    *,
    tp_mesh,
    dp_mesh,
    dp_shard: bool,
    activation_checkpointing: bool,
    loss_parallel: bool,
    reshard_after_forward: bool = True,
):
    if tp_mesh is not None and tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, tp_plan(model, loss_parallel=loss_parallel))
    if activation_checkpointing:
        for block in model.layers.values():
            block.checkpoint_activations = True
    if dp_mesh is not None and dp_mesh.size() > 1:
        blocks = list(model.layers.values())
        apply_data_parallel(model, dp_mesh, shard=dp_shard, blocks=blocks, reshard_after_forward=reshard_after_forward)
    return model
