"""Pipeline stages and schedules from torch.distributed.pipelining."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = {"gpipe", "1f1b"}


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
    pipeline_stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in stages]
    for stage in pipeline_stages if instrument is not None else ():
        instrument(stage)
    cls = SCHEDULE_CLASSES[schedule]
    if schedule in SINGLE_STAGE:
        (stage,) = pipeline_stages
        return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
