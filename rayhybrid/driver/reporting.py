"""What a run reports to, besides its own files: one interface, `Reporter`, whose hooks the run
log calls at fixed points (as Ray Train v2's callbacks: `before_`/`after_` hooks a controller
calls), attached with `RunLog.attach` rather than wired in by attribute.

    runlog.attach(Observer(cfg, runlog.dir))         # adds FLOP/s and MFU, the figures at close
    runlog.attach(Tracked(Trackers.open(...)))       # W&B, MLflow, TensorBoard get every record

The run log attaches one itself: the wall clock (`rayhybrid.driver.wallclock`, goodput).

The order of the hooks, for each record: `before_step` (a reporter may add figures), the
record written to metrics.jsonl, `after_step`; for an event, written then `on_event`; at the
end `before_close` (a reporter may add figures to the summary), summary.json written, `close`.
Reporters are called in the order they were attached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayhybrid.driver.records import StepMetrics
    from rayhybrid.storage.store import Store
    from rayhybrid.tracking import Trackers


class Reporter:
    """One thing a run reports to. Every hook does nothing here: a reporter overrides those it
    needs."""

    def on_store(self, store: Store) -> None:
        """The run's checkpoint store is open (`rayhybrid.storage.store.Store`)."""

    def after_workers_start(self, placement: list[dict], description: dict) -> None:
        """The workers (re)started: where each rank is, and how rank 0 describes itself
        (device_name, backend, model_params, ...)."""

    def before_step(self, record: StepMetrics) -> StepMetrics:
        """A step's record before it is written: returns it, with any figures added."""
        return record

    def after_step(self, record: StepMetrics) -> None:
        """A step's record as metrics.jsonl has it."""

    def on_event(self, record: dict) -> None:
        """An event's record (checkpoint, restart, ...) as metrics.jsonl has it."""

    def on_save_blocked(self, step: int, seconds: float) -> None:
        """An asynchronous save of `step` blocked training for `seconds` (its `checkpoint`
        record, with the same `blocked_s`, comes when its upload is committed)."""

    def on_rewind(self, step: int) -> None:
        """The steps after `step` are forgotten: they will be trained again (`RunLog.rewind`)."""

    def before_close(self, summary: dict, history: list[StepMetrics]) -> None:
        """The summary before summary.json is written, and the steps that count: a reporter
        may add figures to `summary`."""

    def close(self, summary: dict) -> None:
        """summary.json's dict, written: the run is over."""


class Tracked(Reporter):
    """The experiment trackers (`rayhybrid.tracking.Trackers`) as a reporter: every step and
    event record, and the summary when the run ends."""

    def __init__(self, trackers: Trackers) -> None:
        self.trackers = trackers

    def after_step(self, record: StepMetrics) -> None:
        self.trackers.step(record)

    def on_event(self, record: dict) -> None:
        self.trackers.event(record)

    def close(self, summary: dict) -> None:
        self.trackers.close(summary)
