"""Pipeline stages and schedules from torch.distributed.pipelining."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
    _PipelineScheduleRuntime,
)

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


class Stage(PipelineStage):
    """torch's `PipelineStage`, without the warm-up messages a rank would send to itself. torch
    2.11 warms a pipeline up with a message to each neighbouring stage
    (`_get_init_p2p_neighbors_ops`), its own rank's included where a V schedule (zbv) puts two
    neighbouring stages on one rank; gloo cannot send to its own rank ("Pair is not connected"),
    and such a message carries nothing. torch 2.13 warms up with a vote and does not ask for
    these messages (docs/torch-versions.md)."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


def build_schedule(
    schedule: str,
    stages: list[tuple[int, nn.Module]],
    *,
    num_stages: int,
    device: torch.device,
    group: torch.distributed.ProcessGroup,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    instrument: Callable[[PipelineStage], None] | None = None,
):
    """Wrap each (stage index, module) in a PipelineStage and build the named schedule.

    Gradients are not rescaled by the schedule (`scale_grads=False`): the loss function is
    already normalised by the replica's token count, so micro-batch gradients add up to the
    gradient of the replica's mean loss. `instrument` is called with each `PipelineStage` (the
    memory meter labels its forward and backward chunks).
    """
    pipeline_stages = [Stage(module, index, num_stages, device, group=group) for index, module in stages]
    for stage in pipeline_stages if instrument is not None else ():
        instrument(stage)
    cls = SCHEDULE_CLASSES[schedule]
    if issubclass(cls, PipelineScheduleSingle):  # torch's one-stage-per-rank schedules
        (stage,) = pipeline_stages
        return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


FORWARD_ORDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A multi-stage schedule -> its forward-only action list, lowered once (`forward_only`); kept
here rather than on torch's object, and gone with the schedule."""


def forward_only(schedule, *args, **kwargs) -> None:
    """One forward-only pass of the whole batch through `schedule` (evaluation): torch's
    `schedule.eval`, which runs the schedule without its backward. The multi-stage schedules
    (interleaved, zero bubble, ZBV) are lowered from an action list whose backward actions
    `eval` still visits, and ZBV's, which hands a gradient between the two stages a rank holds,
    fails there (torch 2.13: "can't steal_bwd_input if this stage doesn't have backward"). For
    those the pass runs a list of the forward actions alone, in the schedule's own order
    (lowered once, with its sends and receives), and the training list is put back after."""
    if not isinstance(schedule, _PipelineScheduleRuntime):
        schedule.eval(*args, **kwargs)
        return
    training = schedule.pipeline_order_with_comms
    forward = FORWARD_ORDERS.get(schedule)
    if forward is None:
        compute = {
            rank: [a for a in actions if a is not None and a.computation_type == _ComputationType.FORWARD]
            for rank, actions in schedule.pipeline_order.items()
        }
        # torch's lowering (`_prepare_schedule_with_comms`) validates that every micro-batch
        # has its backward; its steps, without that check.
        forward = _add_send_recv(
            {rank: _add_unshard_reshard(actions) for rank, actions in compute.items()},
            stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s],
            num_stages=schedule._num_stages,
        )
        FORWARD_ORDERS[schedule] = forward
    schedule.pipeline_order_with_comms = forward
    try:
        schedule.eval(*args, **kwargs)
    finally:
        schedule.pipeline_order_with_comms = training
