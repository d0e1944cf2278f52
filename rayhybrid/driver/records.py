"""What a run records, as typed records, and the one writer of its outputs.

    log = RunLog(cfg)                       # <run dir>/metrics.jsonl, step lines, progress bar
    log.step(metrics)                       # one optimizer step (a dict from the workers)
    log.interruption(interruption)          # a restart or resize, once its first step is done
    log.event(record)                       # checkpoint, resume, fault_injected
    log.close(summary)                      # summary.json
    log.trackers = Trackers.open(...)       # W&B / MLflow get every record too (rayhybrid.tracking)

`metrics.jsonl` holds one JSON object per line: a step record (has "loss"), or an event (has
"event": resume, checkpoint, restart, resize, fault_injected). A step trained again after a
recovery replaces its earlier record (`rewind`), so every step appears once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from rayhybrid.config.schema import Config

log = logging.getLogger("rayhybrid")


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
    bubble: float | None
    """The pipeline's idle share of the step, over ranks."""
    peak_mb: dict[str, float]
    """metrics.memory: "rank<r>/stage<s>/<phase>" -> MB."""
    activation_mb: dict[str, float]
    val_loss: float
    """The held-out loss after this step (eval.every; absent on other steps)."""
    eval_s: float
    """Seconds the evaluation took (not in step_time_s)."""
    tflops: float
    mfu: float | None
    time: float
    """Wall clock when the driver had the step."""


TIMINGS = ("detect_s", "save_s", "teardown_s", "place_s", "init_s", "restore_s", "first_step_s")


@dataclass
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

    def close(self, first_step_s: float) -> None:
        """The first step after is done: `total_s` runs from the last step before it."""
        self.first_step_s = first_step_s
        self.total_s = time.perf_counter() - self.since + self.detect_s

    def restart_record(self) -> dict:
        return {
            "event": "restart",
            "restart": self.restart,
            "failed_step": self.step,
            "cause": self.cause,
            "resume_step": self.resume_step,
            "replaced_ranks": self.replaced_ranks,
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
    startup_s: float | None = None
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


class ProgressBar:
    """A one-line bar redrawn on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, stream=None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.text = ""

    def update(self, done: int, loss: float, eta_s: float) -> None:
        width = 30
        filled = int(width * done / max(1, self.total))
        self.text = (
            f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} loss {loss:.4f} eta {duration(eta_s)}"
        )
        self.draw()

    def draw(self) -> None:
        if self.enabled and self.text:
            self.stream.write("\r\033[K" + self.text)
            self.stream.flush()

    def clear(self) -> None:
        if self.enabled and self.text:
            self.stream.write("\r\033[K")
            self.stream.flush()


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class RunLog:
    """metrics.jsonl, step lines, progress bar and summary.json for one run directory: the
    only writer of these files."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.run_dir or ".").resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics_file = open(self.metrics_path, "a", buffering=1)  # noqa: SIM115 - open for the run
        self.bar = ProgressBar(cfg.train.steps)
        self.history: list[StepMetrics] = []
        self.started = time.perf_counter()
        self.trackers = None
        """Experiment trackers (rayhybrid.tracking.Trackers) that get every record too."""

    def step(self, metrics: StepMetrics) -> None:
        metrics["time"] = time.time()  # wall clock when the driver had the step (for step-to-step intervals)
        self.history.append(metrics)
        self._write(metrics)
        if self.trackers is not None:
            self.trackers.step(metrics)
        step, total = metrics["step"], self.cfg.train.steps
        evaluated = metrics.get("val_loss") is not None
        if step % self.cfg.train.log_every == 0 or step == total or step == 1 or evaluated:
            self.bar.clear()
            extra = (f" | val_loss {metrics['val_loss']:.4f}" if evaluated else "") + "".join(
                f" | {name} {metrics[key]:.1%}"
                for key, name in (("mfu", "MFU"), ("bubble", "bubble"))
                if metrics.get(key) is not None
            )
            log.info(
                "step %*d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s | %.2fs/step%s",
                len(str(total)),
                step,
                total,
                metrics["loss"],
                metrics["lr"],
                metrics["grad_norm"],
                f"{metrics['tokens_per_s']:,.0f}",
                metrics["step_time_s"],
                extra,
            )
        eta = (time.perf_counter() - self.started) / max(1, len(self.history)) * (total - step)
        self.bar.update(step, metrics["loss"], eta)

    def event(self, record: dict) -> None:
        """A non-step record (has an "event" key)."""
        self._write(record)
        if self.trackers is not None:
            self.trackers.event(record)

    def interruption(self, intr: Interruption, summary: RunSummary) -> None:
        """A restart or resize whose first step is done: its records, in the summary too."""
        if intr.kind == "restart":
            record = intr.restart_record()
            summary.recoveries.append({k: v for k, v in record.items() if k != "event"})
            self.event(record)
            log.warning(
                "recovered from the failure at step %d in %.1fs (teardown %.1fs, place %.1fs, init %.1fs, "
                "restore %.1fs, first step %.1fs)",
                intr.step,
                intr.total_s,
                intr.teardown_s,
                intr.place_s,
                intr.init_s,
                intr.restore_s,
                intr.first_step_s,
            )
        if intr.dp_after != intr.dp_before:
            record = intr.resize_record()
            summary.resizes.append(record)
            self.event(record)
            log.warning(
                "resized dp %d -> %d (%s): %.1fs from the last step before to the first step after",
                intr.dp_before,
                intr.dp_after,
                record["cause"],
                intr.total_s,
            )

    def rewind(self, step: int) -> None:
        """Forget steps after `step` (they will be trained again from a checkpoint), in memory
        and in metrics.jsonl, so every step appears once with the values that count."""
        self.history = [m for m in self.history if m["step"] <= step]
        self.metrics_file.close()
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            record = json.loads(line)
            if "event" in record or record["step"] <= step:
                kept.append(line)
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.metrics_path)
        self.metrics_file = open(self.metrics_path, "a", buffering=1)  # noqa: SIM115 - open for the run

    def write_json(self, name: str, data, indent: int = 1) -> None:
        """A JSON file in the run directory, replaced atomically (workers.json, summary.json)."""
        path = self.dir / name
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=indent) + "\n")
        os.replace(tmp, path)

    def close(self, summary: RunSummary) -> dict:
        self.bar.clear()
        self.metrics_file.close()
        data = summary.to_dict()
        self.write_json("summary.json", data, indent=2)
        if self.trackers is not None:
            self.trackers.close(data)
        return data

    def _write(self, record: dict) -> None:
        self.metrics_file.write(json.dumps(record) + "\n")


def mean_throughput(history: list[dict]) -> float:
    """Tokens/s over the steps after the first (which includes warm-up)."""
    steady = history[1:] or history
    seconds = sum(m["step_time_s"] for m in steady)
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in steady)
    return round(tokens / seconds, 1) if seconds > 0 and not math.isnan(tokens) else 0.0
