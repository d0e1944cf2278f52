"""The forward and backward passes of one replica batch through this rank's stages, one class
per way of running them; the `Trainer` owns one and calls it the same way either way:

    passes = Accumulate(model, n, loss_fn, timeline, phase, device)   # pp=1: one stage
    passes = Pipelined(schedule, has_first, has_last, timeline, device) # pp>1: a torch schedule
    loss = passes.forward_backward(inputs, targets)   # gradients; this rank's part of the loss
    loss = passes.forward_only(inputs, targets)       # evaluation: the loss alone

Both return this rank's part of the replica batch's mean loss (non-zero on last stages only):
`loss_fn` divides each micro-batch's summed loss by the replica's token count, so the
micro-batches' losses add up to the replica's mean. Neither reads data nor steps an optimizer:
the trainer's step does both around them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from rayhybrid.trainer.instrument import timed_schedule
from rayhybrid.trainer.timeline import Timeline

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Accumulate:
    """No pipeline: the rank's one stage over the replica batch's micro-batches in turn, the
    gradients accumulated, and synchronised over dp on the last micro-batch only."""

    def __init__(
        self,
        model: torch.nn.Module,
        n_microbatches: int,
        loss_fn: LossFn,
        timeline: Timeline,
        phase: Callable[[int, str], None],
        device: torch.device,
    ) -> None:
        self.model, self.n = model, n_microbatches
        self.loss_fn, self.timeline, self.phase, self.device = loss_fn, timeline, phase, device

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model, n = self.model, self.n
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(i == n - 1)
            self.phase(0, "forward")
            with self.timeline.span(f"F{i}", "forward", busy=True, stage=0, microbatch=i):
                loss = self.loss_fn(model(x), y)
            self.phase(0, "backward")
            with self.timeline.span(f"B{i}", "backward", busy=True, stage=0, microbatch=i):
                loss.backward()
            total += local(loss.detach())
        return total

    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = self.n
        return sum(local(self.loss_fn(self.model(x), y)) for x, y in zip(inputs.chunk(n), targets.chunk(n)))


class Pipelined:
    """A torch pipeline schedule over the rank's stages (built with the trainer's `loss_fn`):
    a rank with the first stage gives it the inputs, one with the last gives it the targets and
    gets the micro-batches' losses back."""

    def __init__(self, schedule, has_first: bool, has_last: bool, timeline: Timeline, device: torch.device) -> None:
        self.schedule, self.has_first, self.has_last = schedule, has_first, has_last
        self.timeline, self.device = timeline, device

    def forward_backward(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        def step(*args, **kwargs) -> None:
            with timed_schedule(self.timeline):
                self.schedule.step(*args, **kwargs)

        return self._run(step, inputs, targets)

    def forward_only(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        from rayhybrid.parallel.pipeline import forward_only

        return self._run(functools.partial(forward_only, self.schedule), inputs, targets)

    def _run(self, run, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """`run` (the schedule's step, or its forward-only pass) on the replica batch, each rank
        giving what its stages take."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        run(*args, **kwargs)
        if self.has_last:
            return torch.stack([local(x.detach()) for x in losses]).sum()
        return torch.zeros((), device=self.device)


def local(x: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: a DTensor's (loss parallel) full value."""
    return x.full_tensor() if isinstance(x, DTensor) else x
