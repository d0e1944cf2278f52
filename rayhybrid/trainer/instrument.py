"""Hooks into torch's pipeline schedules for the timeline and the memory meter.

    build_schedule(..., instrument=functools.partial(instrument_stage, timeline=tl, phase=fn))
    with timed_schedule(timeline):  # the schedule's wall time; on a traced step, its p2p waits
        schedule.step(...)

`instrument_stage` wraps a `PipelineStage`'s chunk methods: each chunk is a timeline span (busy
time, for the bubble) and first calls `phase(stage, "forward" | "backward")`, the memory
meter's label. `timed_p2p` swaps the module-level function the schedules wait through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from rayhybrid.trainer.timeline import Timeline

CHUNKS = (
    ("forward_one_chunk", "forward", "F"),
    ("backward_one_chunk", "backward", "B"),
    ("backward_weight_one_chunk", "backward", "W"),
)
"""(PipelineStage method, phase, span letter) of each kind of chunk a schedule runs."""


def instrument_stage(stage, *, timeline: Timeline, phase: Callable[[int, str], None]) -> None:
    """Time and label a pipeline stage's chunks: spans for the timeline (and its bubble),
    phases for the memory meter."""
    for method, name, letter in CHUNKS:
        setattr(stage, method, _chunk(getattr(stage, method), stage.stage_index, name, letter, timeline, phase))


def _chunk(fn, stage: int, name: str, letter: str, timeline: Timeline, phase: Callable[[int, str], None]):
    def run(chunk, *args, **kwargs):
        phase(stage, name)
        with timeline.span(f"{letter}{chunk}", name, busy=True, stage=stage, microbatch=chunk):
            return fn(chunk, *args, **kwargs)

    return run


@contextlib.contextmanager
def timed_schedule(timeline: Timeline):
    """Around a schedule's step: its wall time (the bubble's denominator, `Timeline.pipeline`)
    and, on a traced step, spans for its waits on sends and receives."""
    with timeline.pipeline(), timed_p2p(timeline) if timeline.record else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def timed_p2p(timeline: Timeline):
    """Spans for the schedule's waits on sends and receives (a traced step only): the
    schedules wait through one module-level function, looked up at each call."""
    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p

    def wait(work):
        with timeline.span("p2p wait", "comm"):
            original(work)

    schedules._wait_batch_p2p = wait
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original
