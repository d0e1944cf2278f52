"""Where a rank's step time goes: compute spans, communication waits, the pipeline bubble.

    timeline = Timeline(rank)
    timeline.begin_step(record=True)                 # record spans for trace.json this step
    with timeline.span("F0", "forward", stage=1):    # real timings (perf_counter durations,
        ...                                          # wall-clock start times across processes)
    timeline.bubble()                                # idle share of the pipeline's time

Spans are Chrome trace "complete" events (`ph: X`): one process per rank, compute on thread 0,
communication on thread 1, so Perfetto (ui.perfetto.dev) shows the pipeline schedule rank by
rank. The bubble fraction is measured on every pipeline step: the share of the schedule's wall
time in which the rank ran no forward or backward chunk (it waited for a neighbour).
"""

from __future__ import annotations

import contextlib
import time

import torch

from rayhybrid.trainer.split import StepClock, split_step

COMM = {"comm"}  # categories drawn on the communication thread


class Timeline:
    def __init__(self, rank: int, device: torch.device | None = None) -> None:
        self.rank = rank
        self.clock = StepClock(device)  # the step's time by part (trainer/split.py): busy spans are compute
        self.ideal_bubble = 0.0  # the schedule's idle share without communication (`split.ideal_bubble`)
        self.record = False
        self.events: list[dict] = []
        self.busy_s = 0.0  # forward/backward chunk time inside the pipeline schedule, this step
        self.window_s = 0.0  # the pipeline schedule's wall time, this step
        # perf_counter -> wall clock in microseconds, so ranks in different processes line up.
        self._offset_us = time.time() * 1e6 - time.perf_counter() * 1e6

    def begin_step(self, record: bool, measure: bool = True) -> None:
        """A step begins (`measure`: a training step, its time split by the clock; else an
        evaluation, whose time the clock leaves out)."""
        self.record = record
        self.events = []
        self.busy_s = self.window_s = 0.0
        if measure:
            self.clock.begin()
        else:
            self.clock.end()

    @contextlib.contextmanager
    def span(self, name: str, category: str, busy: bool = False, **args):
        start = time.perf_counter()
        try:
            if busy:
                with self.clock.part("compute"):
                    yield
            else:
                yield
        finally:
            end = time.perf_counter()
            if busy:
                self.busy_s += end - start
            if self.record:
                self.events.append(
                    {
                        "name": name,
                        "cat": category,
                        "ph": "X",
                        "pid": self.rank,
                        "tid": 1 if category in COMM else 0,
                        "ts": round(start * 1e6 + self._offset_us, 1),
                        "dur": round((end - start) * 1e6, 1),
                        "args": args,
                    }
                )

    @contextlib.contextmanager
    def pipeline(self):
        """Around the schedule's step: its wall time is the bubble's denominator."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.window_s += time.perf_counter() - start

    def split(self, step_time_s: float) -> dict:
        """The step ends: {"split": its seven parts adding up to `step_time_s`, "compute_s": this
        rank's own compute} (trainer/split.py; the bubble's rule there, `split_step`)."""
        split = split_step(self.clock.end(), step_time_s, window_s=self.window_s, ideal=self.ideal_bubble)
        return {"split": split, "compute_s": split["compute_s"]}

    def bubble(self) -> float | None:
        """Idle share of this step's pipeline time on this rank (None without a pipeline)."""
        if self.window_s <= 0:
            return None
        return max(0.0, 1.0 - self.busy_s / self.window_s)


def chrome_trace(events: list[dict], ranks: list[dict]) -> dict:
    """A Chrome trace (JSON object format) of `events`, with a named, ordered process per rank
    (`ranks`: [{"rank", "dp", "pp", "tp"}, ...]) and named threads."""
    meta = []
    for r in ranks:
        pid = r["rank"]
        label = f"rank {pid} (dp {r['dp']}, pp {r['pp']}, tp {r['tp']})"
        meta += [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "communication"}},
        ]
    return {"traceEvents": meta + sorted(events, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}
