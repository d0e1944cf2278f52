"""What the workers give back to the driver, declared once: a step (`StepResult`, whose figures
are a `StepMetrics`), a checkpoint save (`SaveResult`), the state a rank kept for healing
(`HeldState`), a heal (`HealResult`) and a restore (`RestoreResult`).

The trainer builds them, the worker group merges the ranks' (`rayhybrid/cluster/merge.py`) and
the driver reads them. Plain frozen values with no torch in them: they cross Ray's process
boundary by pickling, and the driver (which never imports torch) imports this module alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

SPLIT_PARTS = ("compute_s", "data_wait_s", "bubble_s", "comm_dp_s", "comm_tp_s", "comm_pp_s", "host_s")
"""The MFU split's parts (`StepMetrics.split`), in the order its table shows them
(trainer/split.py measures them; docs/observability.md, "The MFU split")."""


class StepMetrics(TypedDict, total=False):
    """One optimizer step, as `metrics.jsonl` stores it: rank 0's figures from the trainer,
    merged with every rank's by the worker group, completed by the observer and the log."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    consumed_samples: int
    num_microbatches: int
    dp: int
    pp: int
    tp: int
    samples: list[list[int]]
    """[first sample, count] read by each data-parallel replica, in dp order."""
    samples_read: list[int]
    """This rank's [first sample, count] (a rank's own figures; the merge turns them into `samples`)."""
    data_wait_s: float
    """The longest any rank waited for its samples in this step (in step_time_s)."""
    cpu_s: float
    data_read: dict[str, list[dict]]
    """data.trace: rank -> what it read (written to data_trace/, not to metrics.jsonl)."""
    bubble: float | None
    """The pipeline's idle share of the step, over ranks."""
    split: dict[str, float]
    """The step's time by part (`SPLIT_PARTS`), adding up to step_time_s: a rank's own, and in
    the record the ranks' mean, scaled to the record's step_time_s."""
    compute_s: float
    """A rank's own compute in the step (its split's compute_s): time blocked on collectives,
    receives, data or the host left out. In the record: the merged split's."""
    compute_s_by_rank: list[float | None]
    """Every rank's compute_s, in rank order (None: a rank with no figures of this step)."""
    peak_mb: dict[str, float]
    """metrics.memory: "rank<r>/stage<s>/<phase>" -> MB."""
    activation_mb: dict[str, float]
    reserved_mb: dict[str, float]
    """metrics.memory on CUDA: the caching allocator's reserved peaks, keyed as `peak_mb`."""
    trace: list[dict]
    """metrics.trace_steps: every rank's spans."""
    val_loss: float
    """The held-out loss after this step (eval.every; absent on other steps)."""
    eval_s: float
    """Seconds the evaluation took (not in step_time_s)."""
    tflops: float
    mfu: float | None
    time: float
    """Wall clock when the driver had the step."""


@dataclass(frozen=True)
class SaveResult:
    """One checkpoint save, as rank 0 saw it. A synchronous save is committed (or failed) when
    it returns; an asynchronous one returns once staged (`pending`) and is reported again when
    its upload ends, with `upload_s` or `error`."""

    step: int
    path: str
    """Where it is written (a URL; may hold credentials: redact before logging)."""
    asynchronous: bool
    waited_s: float
    """Waiting for the previous asynchronous save before this one began."""
    blocked_s: float | None = None
    """How long training stood still for it."""
    upload_s: float | None = None
    """Writing the data to the store (None while an asynchronous upload runs)."""
    error: str | None = None
    """One line, when the save failed (it is then never committed)."""
    finished: tuple[SaveResult, ...] = ()
    """Earlier asynchronous saves that ended while this one waited for them."""

    @property
    def pending(self) -> bool:
        return self.upload_s is None and self.error is None


@dataclass(frozen=True)
class StepResult:
    """One rank's (or, merged, the group's) result of one optimizer step."""

    metrics: StepMetrics
    saves: tuple[SaveResult, ...] = ()
    """Asynchronous saves that ended (committed or failed) during this step."""


@dataclass(frozen=True)
class HeldState:
    """fault.heal: what a worker kept across a failure, when its shards are the ones its new
    trainer holds."""

    step: int
    nbytes: int
    recorded: bool
    """Whether it kept its results of that step (so the step needs no redoing for its record)."""


@dataclass(frozen=True)
class HealResult:
    """One rank's side of a heal: the step it now holds, its record of that step (`StepResult`,
    from `trainer.heal.step_record`), the bytes it sent or received and the seconds taken."""

    step: int
    record: StepResult
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class RestoreResult:
    """A checkpoint loaded on every rank: the step and the samples consumed it restored."""

    step: int
    consumed_samples: int
    seconds: float
