"""What a run records, as typed records: an interruption (a restart or resize, from the last
step before it to the first step after) and the run's summary (summary.json), which is folded
from the records the run log writes (`RunSummary.record`), never set by the driver's states.

`metrics.jsonl` holds one JSON object per line: a step record (has "loss"), or an event (has
"event": resume, heal, checkpoint, checkpoint_failed, restart, resize, preemption,
fault_injected, goodput).
The writer is `rayhybrid.driver.runlog.RunLog`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from rayhybrid.trainer.results import StepMetrics

__all__ = ["TIMINGS", "Interruption", "RunSummary", "StepMetrics", "mean_throughput", "steps_redone"]

TIMINGS = ("detect_s", "save_s", "teardown_s", "place_s", "init_s", "restore_s", "first_step_s")


def steps_redone(last_step: int, resume_step: int) -> int:
    """Completed steps a run trains again after going back from `last_step` (the last the
    driver recorded) to `resume_step`: those since a checkpoint restored; 0 healed forward."""
    return max(0, last_step - resume_step)


@dataclass(frozen=True)
class Interruption:
    """A restart after a failure, or a resize at a checkpoint boundary: from the last step
    before it to the first step after. Timings are seconds; a phase that did not happen is 0."""

    kind: str
    """"restart", "grow" or "preempt" (moved off a draining node)."""
    cause: str
    step: int
    """restart: the step that failed; grow: the last step trained before it."""
    dp_before: int
    restart: int = 0
    """restart: which restart this is (1-based)."""
    dp_after: int = 0
    resume_step: int = 0
    replaced_ranks: list[int] = field(default_factory=list)
    healed: str = ""
    """restart: where the state came from, "peer" (fault.heal) or "checkpoint"."""
    steps_redone: int = 0
    """restart: completed steps trained again (those since the checkpoint restored; 0 healed)."""
    bytes_sent: int = 0
    """restart, healed: the state sent from live replicas to the ranks that lost theirs."""
    detect_s: float = 0.0
    save_s: float = 0.0
    teardown_s: float = 0.0
    place_s: float = 0.0
    init_s: float = 0.0
    restore_s: float = 0.0
    first_step_s: float = 0.0
    total_s: float = 0.0
    since: float = field(default_factory=time.perf_counter, repr=False)
    """perf_counter() at the last step before (grow) or at the failure (restart)."""

    def but(self, **changes) -> Interruption:
        return dataclasses.replace(self, **changes)

    def close(self, first_step_s: float) -> Interruption:
        """The first step after is done: `total_s` runs from the last step before it."""
        return self.but(first_step_s=first_step_s, total_s=time.perf_counter() - self.since + self.detect_s)

    def restart_record(self) -> dict:
        return {
            "event": "restart",
            "restart": self.restart,
            "failed_step": self.step,
            "cause": self.cause,
            "resume_step": self.resume_step,
            "replaced_ranks": self.replaced_ranks,
            "healed": self.healed,
            "steps_redone": self.steps_redone,
            "bytes_sent": self.bytes_sent,
            "dp_before": self.dp_before,
            "dp_after": self.dp_after,
            **{key: round(getattr(self, key), 3) for key in (*TIMINGS, "total_s")},
        }

    def resize_record(self) -> dict:
        """The resize this interruption made (dp changed), as a record of its own; `step` is the
        last step trained before it took effect (the checkpoint it resumed from)."""
        cause = f"replica lost ({self.cause})" if self.kind == "restart" else self.cause
        return {
            "event": "resize",
            "step": self.resume_step,
            "from_dp": self.dp_before,
            "to_dp": self.dp_after,
            "cause": cause,
            **{key: round(getattr(self, key), 3) for key in TIMINGS},
            "resize_s": round(self.total_s, 3),
        }


@dataclass
class RunSummary:
    """summary.json: how the run went, written when it ends (also when it fails)."""

    topology: dict
    model: dict
    data: dict
    global_batch_size: int
    micro_batch_size: int
    run_dir: str
    checkpoint_dir: str
    status: str = "failed"
    steps: int = 0
    initial_loss: float | None = None
    final_loss: float | None = None
    final_val_loss: float | None = None
    """The last held-out loss evaluated (eval.every), and the lowest with its step."""
    best_val_loss: float | None = None
    best_val_step: int | None = None
    best_checkpoint: str | None = None
    """checkpoint.keep_best: the kept checkpoint with the lowest val_loss."""
    consumed_samples: int | None = None
    mean_tokens_per_s: float | None = None
    restarts: int = 0
    recoveries: list[dict] = field(default_factory=list)
    resizes: list[dict] = field(default_factory=list)
    preemptions: list[dict] = field(default_factory=list)
    """Preemption notices the run acted on: node, deadline_s, saved_step, lost_steps."""
    faults_injected: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    """Seconds from the command's start (the run's, from the API) to the summary."""
    startup_s: float | None = None
    """Seconds from the command's start to the end of the first completed step."""
    startup: dict = field(default_factory=dict)
    """`startup_s` by phase, in order (`rayhybrid.trainer.startup.PHASES`); empty until then."""
    train_s: float | None = None
    resumed_from: str | None = None
    resumed_step: int | None = None
    last_checkpoint: str | None = None
    checkpoints: dict = field(default_factory=lambda: {"saved": 0, "failed": 0, "blocked_s": 0.0, "upload_s": 0.0})
    """Saves committed and failed; the seconds they blocked training and their uploads took, in all."""
    error: str | None = None
    workers: dict = field(default_factory=dict)
    """What the workers said of themselves: placement, device, backend, params, loss_floor."""
    figures: dict = field(default_factory=dict)
    """What the observer adds at the end: FLOP/s, MFU, bubble, memory, plots."""

    def record(self, record: dict) -> None:
        """Fold one event of metrics.jsonl into the summary (`RunLog.event` calls it)."""
        kind, fields = record["event"], {k: v for k, v in record.items() if k != "event"}
        if kind == "checkpoint":
            c = self.checkpoints
            c["saved"] += 1
            c["blocked_s"] = round(c["blocked_s"] + (record.get("blocked_s") or 0.0), 3)
            c["upload_s"] = round(c["upload_s"] + (record.get("upload_s") or 0.0), 3)
            self.last_checkpoint = record.get("path")
        elif kind == "checkpoint_failed":
            self.checkpoints["failed"] += 1
        elif kind == "resume":
            if self.resumed_from is None:
                self.resumed_from = record["checkpoint"]
            self.resumed_step = record["step"]
        elif kind == "fault_injected":
            self.faults_injected.append(record)
        elif kind == "preemption":
            self.preemptions.append(fields)
        elif kind == "restart":
            self.recoveries.append(fields)
        elif kind == "resize":
            self.resizes.append(record)

    def finish(self, history: list[dict]) -> None:
        """Fill the figures that come from the step records."""
        if history:
            first, last = history[0], history[-1]
            self.steps, self.initial_loss, self.final_loss = last["step"], first["loss"], last["loss"]
            self.consumed_samples = last["consumed_samples"]
        elif self.resumed_step is not None:
            self.steps = self.resumed_step
        evaluated = [m for m in history if m.get("val_loss") is not None]
        if evaluated:
            self.final_val_loss = evaluated[-1]["val_loss"]
            best = min(evaluated, key=lambda m: m["val_loss"])
            self.best_val_loss, self.best_val_step = best["val_loss"], best["step"]
        self.mean_tokens_per_s = mean_throughput(history)

    def to_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("workers", "figures")}
        if not out["startup"]:
            del out["startup"]
        for optional in (
            "startup_s",
            "train_s",
            "resumed_from",
            "resumed_step",
            "last_checkpoint",
            "error",
            "final_val_loss",
            "best_val_loss",
            "best_val_step",
            "best_checkpoint",
        ):
            if out[optional] is None:
                del out[optional]
        return {**out, **self.workers, **self.figures}


def mean_throughput(history: list[dict]) -> float:
    """Tokens/s over the steps after the first (which includes warm-up)."""
    steady = history[1:] or history
    seconds = sum(m["step_time_s"] for m in steady)
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in steady)
    return round(tokens / seconds, 1) if seconds > 0 and not math.isnan(tokens) else 0.0
