"""What a rank trains with, built from the config: its pipeline stages (the model's spec, made and
parallelised on the meta device, then this rank's shards materialised and initialised), one
optimizer per stage, the pipeline schedule over them, and the memory meter.

    stages = build_stages(cfg, spec, layout, mesh, device, pp_rank=coord.pp, loss_parallel=...)
    loss = build_loss(cfg, spec, layout, stages)  # the last stage's output into the loss
    optimizers = build_optimizers(stages, cfg.train)
    schedule = build_pipeline(cfg, layout, stages, mesh, device, loss_fn, instrument)  # None: pp == 1
    memory = build_memory_meter(cfg, device, stages, optimizers)  # None: metrics.memory off
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from rayhybrid.config.schema import Config, TrainConfig
from rayhybrid.config.topology import Layout
from rayhybrid.errors import TESTED_TORCH
from rayhybrid.models.spec import ModelSpec
from rayhybrid.parallel.compile import check_compile, check_compiler
from rayhybrid.parallel.float8 import check_float8, convert_blocks
from rayhybrid.parallel.materialise import materialise
from rayhybrid.parallel.mesh import data_parallel_mesh, split_dp
from rayhybrid.storage.store import one_line
from rayhybrid.trainer.loss import TokenLoss
from rayhybrid.trainer.optim import build_optimizer
from rayhybrid.trainer.startup import mark

if TYPE_CHECKING:
    from rayhybrid.trainer.memory_meter import MemoryMeter

Stages = list[tuple[int, torch.nn.Module]]
"""(stage index, module) for each pipeline stage a rank owns, in the order it owns them."""


def build_stages(
    cfg: Config,
    spec: ModelSpec,
    layout: Layout,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    pp_rank: int,
    loss_parallel: bool,
) -> Stages:
    """The pipeline stages pipeline rank `pp_rank` owns, each keeping the full model's parameter
    names. `train.float8` that cannot run on `device`, or `train.compile` with a schedule this
    torch cannot run compiled or without inductor's C++ compiler on a CPU: ConfigError before
    any is built (the blocks are compiled on the meta device, where no compiler is looked for)."""
    check_float8(cfg.train.float8, device)
    check_compile(cfg.train.compile, cfg.topology.schedule, cfg.topology.pp)
    if cfg.train.compile:
        check_compiler(device)
    mesh = split_dp(mesh, cfg.topology.shard_group)  # HSDP: dp as ("dp_replicate", "dp_shard"), once
    ranges, stages = layout.stage_layers, []
    for i in layout.stages_of(pp_rank):
        stage = build_stage(
            cfg, spec, mesh, device, i, ranges[i], num_stages=layout.num_stages, loss_parallel=loss_parallel
        )
        stages.append((i, stage))
        mark("parallelize")  # build_stage marks the model's build and init
    return stages


def build_stage(
    cfg: Config,
    spec: ModelSpec,
    mesh: DeviceMesh,
    device: torch.device,
    index: int,
    layers: range,
    *,
    num_stages: int,
    loss_parallel: bool,
) -> torch.nn.Module:
    """One pipeline stage of the model its spec builds (full parameter names), made on the
    meta device, its blocks' linears made float8 (`train.float8`), parallelised there (TP, AC,
    compile, dp), then materialised: this rank's shards only, each the slice of the stage's
    `init_value` (rayhybrid/parallel/materialise.py). A stage without `init_value` (a model
    written before it) is materialised whole, initialised (`init_weights`), then parallelised."""
    with torch.device("meta"):
        stage = spec.build_stage(
            cfg.model,
            seq_len=cfg.data.seq_len,
            layer_ids=layers,
            first=index == 0,
            last=index == num_stages - 1,
        )
    parallelize = functools.partial(
        spec.parallelize,
        tp_mesh=mesh["tp"],
        dp_mesh=data_parallel_mesh(mesh),  # 2-D (replicate, shard) with HSDP
        dp_shard=cfg.topology.shard_group > 1,
        activation_checkpointing=cfg.train.activation_checkpointing,
        loss_parallel=loss_parallel,
        reshard_after_forward=cfg.topology.pp == 1,
        **({"compile": True} if cfg.train.compile else {}),  # only when on: a spec may not take it
        **({"offload_activations": True} if cfg.train.offload_activations else {}),
    )
    init_value = getattr(stage, "init_value", None)
    if not callable(init_value):
        materialise(stage, device)  # the whole stage, empty
        stage.init_weights(cfg.seed)
        convert_blocks(stage, cfg.train.float8, tp=cfg.topology.tp)
        mark("model_build")
        return parallelize(stage)
    convert_blocks(stage, cfg.train.float8, tp=cfg.topology.tp)
    mark("model_build")
    stage = parallelize(stage)
    mark("parallelize")
    materialise(stage, device, lambda name, shape: init_value(name, shape, cfg.seed))
    mark("model_build")  # the materialised shards and their values count to the build
    return stage


def build_loss(cfg: Config, spec: ModelSpec, layout: Layout, stages: Stages) -> TokenLoss:
    """The training loss (rayhybrid/trainer/loss.py), summed over a micro-batch and divided by
    the replica's token count: micro-batch losses add up to the replica's mean loss, and
    averaging over dp gives the global batch's mean. With train.loss_chunk the last stage
    returns its hidden state and the loss runs its output projection in chunks of tokens."""
    return TokenLoss(
        spec,
        stages,
        num_stages=layout.num_stages,
        chunk=cfg.train.loss_chunk,
        micro_batch_tokens=cfg.train.micro_batch_size * cfg.data.seq_len,
        replica_tokens=layout.replica_batch_size * cfg.data.seq_len,
        sharded=cfg.topology.shard_group > 1,
    )


def build_optimizers(stages: Stages, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """One optimizer per stage module, so optimizer state is keyed by that module's full
    parameter names (reshardable checkpoints, see trainer/checkpoint.py)."""
    return [build_optimizer(list(m.parameters()), cfg) for _, m in stages]


def build_pipeline(
    cfg: Config,
    layout: Layout,
    stages: Stages,
    mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    instrument: Callable | None = None,
):
    """The pipeline schedule (`topology.schedule`) over this rank's stages; None without a
    pipeline (pp == 1). `instrument` is called with each of its `PipelineStage`s."""
    t = cfg.topology
    if t.pp <= 1:
        return None
    from rayhybrid.parallel.pipeline import build_schedule  # torch's pipelining imports dynamo: pp > 1 only

    return build_schedule(
        t.schedule,
        stages,
        num_stages=layout.num_stages,
        device=device,
        group=mesh["pp"].get_group(),
        n_microbatches=layout.num_microbatches,
        loss_fn=loss_fn,
        instrument=instrument,
    )


def build_memory_meter(
    cfg: Config, device: torch.device, stages: Stages, optimizers: list[torch.optim.Optimizer]
) -> MemoryMeter | None:
    """The memory meter (`metrics.memory`), or None. On CPU, `tune.memory_budget_mb` is the
    capacity of the device it plays. The meter counts with torch's private `MemTracker`: in a
    torch where it moved, metrics.memory is off after one warning line, and the rest runs."""
    if not cfg.metrics.memory:
        return None
    try:
        from rayhybrid.trainer.memory_meter import MemoryMeter
    except ImportError as err:
        logging.getLogger("rayhybrid").warning(
            "metrics.memory is off: this torch's memory tracker moved (%s); use %s", one_line(err), TESTED_TORCH
        )
        return None
    budget = cfg.tune.memory_budget_mb if device.type == "cpu" else 0.0
    return MemoryMeter(device, [m for _, m in stages], optimizers, budget_mb=budget)
