"""The one writer of a run's outputs: metrics.jsonl, the step lines and progress bar,
workers.json and summary.json; its reporters (`rayhybrid.driver.reporting`: the wall clock's
goodput, attached here, the observer, the experiment trackers) get every record too, at fixed
points.

    log = RunLog(cfg)                             # <run dir>/metrics.jsonl
    log.attach(reporter)                          # the observer, the trackers
    log.checkpoints_in(store.display, store)      # the summary's checkpoint_dir; the reporters get the store
    log.step(metrics)                             # one optimizer step (a dict from the workers)
    log.event(record)                             # checkpoint, resume, fault_injected, preemption, ...
    log.interruption(interruption)                # a restart or resize, once its first step is done
    log.close("completed", restarts=1, ...)       # summary.json

The first start's phases (summary.json's `startup`, `rayhybrid.trainer.startup`) are marked as
the start goes (`phase`, `joined`) and closed by the first completed step (`started_up`).

While the run log is open, Ray's own text goes to the run's log file rather than the terminal
(`RayText`), so a failure rayhybrid handles shows as rayhybrid's one line.

The summary (`RunSummary`) is folded from the records written here and completed at close from
the driver's final run state: the driver's states never write it. A step trained again after a
recovery replaces its earlier record (`rewind`), so every step appears once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import weakref
from pathlib import Path

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import Layout, describe_data_parallel, groups_across_nodes
from rayhybrid.driver.raytext import RayText
from rayhybrid.driver.records import Interruption, RunSummary, StepMetrics
from rayhybrid.driver.reporting import Reporter
from rayhybrid.driver.wallclock import Wallclock
from rayhybrid.storage.store import Store
from rayhybrid.trainer.startup import PhaseClock, critical_path

log = logging.getLogger("rayhybrid")


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
    """metrics.jsonl, step lines, progress bar, workers.json and summary.json for one run
    directory: the only writer of these files."""

    def __init__(self, cfg: Config, started: float | None = None) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.run_dir or ".").resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics_file = open(self.metrics_path, "a", buffering=1)  # noqa: SIM115 - open for the run
        self.bar = ProgressBar(cfg.train.steps)
        self.history: list[StepMetrics] = []
        self.started = time.perf_counter()
        self.clock = PhaseClock(started)
        """The first start's phases, from `started` (wall clock: the command's start; default now)."""
        self.data_trace = DataTrace(self.dir / "data_trace")
        self.ray_text = RayText(self.dir)
        """Ray's own text, in the run's log file until `close` (or until this run log is gone)."""
        weakref.finalize(self, self.ray_text.close)
        self.reporters: list[Reporter] = []
        """What gets every record too, in the order attached: the observer (FLOP/s, MFU, the
        figures at close), the experiment trackers."""
        self.summary = RunSummary(
            topology={**dataclasses.asdict(cfg.topology), **Layout.of(cfg).summary()},
            model=dataclasses.asdict(cfg.model),
            data={"name": cfg.data.name, "seq_len": cfg.data.seq_len},
            global_batch_size=cfg.train.global_batch_size,
            micro_batch_size=cfg.train.micro_batch_size,
            run_dir=str(self.dir),
            checkpoint_dir="",
        )
        self.attach(Wallclock(cfg, self.clock, self.summary, self.dir, emit=self.event))  # goodput

    def attach(self, reporter: Reporter) -> None:
        """`reporter` gets the records from now on (`rayhybrid.driver.reporting`)."""
        self.reporters.append(reporter)

    def checkpoints_in(self, display: str, store: Store | None = None) -> None:
        """Where the run's checkpoints go, as the summary shows it (redacted); the store, when open."""
        self.summary.checkpoint_dir = display
        for reporter in self.reporters if store is not None else []:
            reporter.on_store(store)

    def step(self, metrics: StepMetrics) -> StepMetrics:
        """Record one step (after the reporters' figures); returns the record."""
        if "data_read" in metrics:  # data.trace: to data_trace/, not to metrics.jsonl
            self.data_trace.write(metrics.pop("data_read"))
        for reporter in self.reporters:
            metrics = reporter.before_step(metrics)
        metrics["time"] = time.time()  # wall clock when the driver had the step (for step-to-step intervals)
        self.history.append(metrics)
        self._write(metrics)
        for reporter in self.reporters:
            reporter.after_step(metrics)
        step, total = metrics["step"], self.cfg.train.steps
        if step % self.cfg.train.log_every == 0 or step == total or step == 1 or metrics.get("val_loss") is not None:
            self.bar.clear()
            log.info(step_line(metrics, total))
        eta = (time.perf_counter() - self.started) / max(1, len(self.history)) * (total - step)
        self.bar.update(step, metrics["loss"], eta)
        return metrics

    def event(self, record: dict) -> None:
        """A non-step record (has an "event" key); the summary folds it in."""
        self._write(record)
        self.summary.record(record)
        for reporter in self.reporters:
            reporter.on_event(record)

    def save_blocked(self, step: int, seconds: float | None) -> None:
        """An asynchronous save of `step` blocked training for `seconds` (its record: at the commit)."""
        for reporter in self.reporters:
            reporter.on_save_blocked(step, seconds or 0.0)

    def injected(self, injection):
        """A `fault.inject` fault due now (or None), recorded before it fires; returns it."""
        if injection is not None:
            self.event(injection.record())
            log.warning(
                "fault.inject: %s on rank %d at step %d (%s)",
                injection.kind,
                injection.rank,
                injection.step,
                injection.phase,
            )
        return injection

    def resizing(self, dp: int, to_dp: int, intr: Interruption) -> None:
        """A grow begins (at a checkpoint boundary)."""
        log.warning(
            "resize dp %d -> %d at step %d: %s; restarting from the checkpoint just written",
            dp,
            to_dp,
            intr.step,
            intr.cause,
        )

    def interrupted(self, intr: Interruption, err: Exception) -> None:
        """A restart or resize that failed before its first step: its record, with why."""
        record = intr.restart_record() if intr.kind == "restart" else intr.resize_record()
        self.event(record | {"interrupted": str(err), "total_s": round(time.perf_counter() - intr.since, 3)})

    def interruption(self, intr: Interruption) -> None:
        """A restart or resize whose first step is done: its records."""
        if intr.kind == "restart":
            self.event(intr.restart_record())
            log.warning(
                "recovered from the failure at step %d in %.1fs (teardown %.1fs, place %.1fs, init %.1fs, "
                "%s %.1fs, first step %.1fs; %d step(s) redone)",
                intr.step,
                intr.total_s,
                intr.teardown_s,
                intr.place_s,
                intr.init_s,
                "healed from peers" if intr.healed == "peer" else "restore",
                intr.restore_s,
                intr.first_step_s,
                intr.steps_redone,
            )
        if intr.dp_after != intr.dp_before:
            record = intr.resize_record()
            self.event(record)
            log.warning(
                "resized dp %d -> %d (%s): %.1fs from the last step before to the first step after",
                intr.dp_before,
                intr.dp_after,
                record["cause"],
                intr.total_s,
            )

    def workers(self, cfg: Config, placement: list[dict], pids: list[int], first: dict) -> None:
        """The workers as they describe themselves, once they are (re)started: workers.json, and
        the summary's topology and workers."""
        self.write_json("workers.json", [{**p, "pid": pid} for p, pid in zip(placement, pids)])
        t = cfg.topology
        if t.hsdp and (spanning := groups_across_nodes(placement, t.shard_group)):
            log.warning(
                "HSDP: %d shard group(s) span nodes (ranks %s), so their parameters are gathered across nodes "
                "every step; place %d replicas per node (more devices per node) or lower topology.dp_shard",
                len(spanning),
                spanning[0],
                t.shard_group,
            )
        self.summary.topology.update(Layout.of(cfg).summary())
        self.summary.workers = {
            "placement": placement,
            "device_name": first["device_name"],
            "backend": first["backend"],
            "device": first["device"],
            "params": first["model_params"],
            "loss_floor": first["loss_floor"],
        }
        for reporter in self.reporters:
            reporter.after_workers_start(placement, first)

    def phase(self, name: str) -> None:
        """A phase of the first start ends now (`rayhybrid.trainer.startup.PHASES`)."""
        if self.summary.startup_s is None:
            self.clock.mark(name)

    def joined(self, readings: list[dict | None]) -> None:
        """The workers answered that their trainers are built: their phases (each worker's
        reading of its clock) from the end of the last phase to now, along the critical path."""
        if self.summary.startup_s is not None:
            return
        now = time.time()
        for name, seconds in critical_path([r for r in readings if r], self.clock.last, now).items():
            self.clock.add(name, seconds)
        self.clock.last = now

    def started_up(self, workers: int, first_batch_s: float) -> None:
        """The first step is done: the start-up's phases and time, and a line saying so (once a
        run). `first_batch_s`: the first step's wait for its samples (the slowest rank's)."""
        s = self.summary
        if s.startup_s is not None:
            return
        first = time.time() - self.clock.last
        # The first batch's wait is the first part of the first step: marked as its own phase,
        # so that the clock moves past it and the first step keeps only the rest.
        self.clock.mark("first_batch", now=self.clock.last + min(first, max(0.0, first_batch_s)))
        self.clock.mark("first_step")
        s.startup, s.startup_s = self.clock.ordered(), round(self.clock.last - self.clock.since, 3)
        floor, params = s.workers.get("loss_floor"), s.workers.get("params")  # none before `workers`
        log.info(
            "started %d workers, first step done in %.1fs (%s); %s parameters; run dir %s%s",
            workers,
            s.startup_s,
            ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in s.startup.items()),
            f"{params:,}" if params is not None else "?",
            self.dir,
            f"; data loss floor {floor:.4f}" if floor is not None else "",
        )

    def rewind(self, step: int) -> None:
        """Forget steps after `step` (they will be trained again from a checkpoint), in memory
        and in metrics.jsonl, so every step appears once with the values that count."""
        self.history = [m for m in self.history if m["step"] <= step]
        for reporter in self.reporters:
            reporter.on_rewind(step)
        self.data_trace.rewind(step)
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

    def close(
        self,
        status: str,
        error: str | None = None,
        *,
        restarts: int = 0,
        train_s: float | None = None,
        best_checkpoint: str | None = None,
    ) -> dict:
        """summary.json, with how the run ended and what the driver's final run state says
        (`restarts`, `train_s`, `best_checkpoint`), and the figures the reporters add; then
        the reporters closed."""
        s = self.summary
        s.status, s.error, s.restarts, s.train_s, s.best_checkpoint = status, error, restarts, train_s, best_checkpoint
        s.finish(self.history)
        s.wall_s = round(time.time() - self.clock.since, 3)
        figures = s.to_dict()
        before = set(figures)
        for reporter in self.reporters:
            reporter.before_close(figures, self.history)  # the observer: FLOP/s, MFU, bubble, memory, plots
        s.figures = {k: v for k, v in figures.items() if k not in before}
        self.bar.clear()
        self.metrics_file.close()
        data = s.to_dict()
        self.write_json("summary.json", data, indent=2)
        for reporter in self.reporters:
            reporter.close(data)
        self.ray_text.close()  # (should something above raise: once this run log is gone)
        return data

    def _write(self, record: dict) -> None:
        self.metrics_file.write(json.dumps(record) + "\n")


class DataTrace:
    """data.trace: `data_trace/rank<r>.jsonl`, one row per sample a rank read (step, sample,
    dataset, epoch, start). Steps trained again after a recovery replace their rows, as in
    metrics.jsonl, so the files say what the run that counts read."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def write(self, by_rank: dict[str, list[dict]]) -> None:
        self.dir.mkdir(exist_ok=True)
        for rank, rows in by_rank.items():
            with open(self.dir / f"rank{rank}.jsonl", "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)

    def rewind(self, step: int) -> None:
        """Forget the rows of steps after `step`."""
        for path in sorted(self.dir.glob("rank*.jsonl")) if self.dir.is_dir() else []:
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)


def step_line(metrics: StepMetrics, total: int) -> str:
    """The line a step prints: loss, lr, gradient norm, throughput, time, and what was measured."""
    extra = (
        (f" | data wait {metrics['data_wait_s'] * 1e3:.1f}ms" if metrics.get("data_wait_s") is not None else "")
        + (f" | val_loss {metrics['val_loss']:.4f}" if metrics.get("val_loss") is not None else "")
        + "".join(
            f" | {name} {metrics[key]:.1%}"
            for key, name in (("mfu", "MFU"), ("bubble", "bubble"))
            if metrics.get(key) is not None
        )
    )
    return (
        f"step {metrics['step']:{len(str(total))}d}/{total} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
        f"grad_norm {metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:,.0f} tok/s | "
        f"{metrics['step_time_s']:.2f}s/step{extra}"
    )


def announce(cfg: Config, scaling, use_gpu: bool) -> None:
    """The run's first lines: its layout (and, elastic, the replicas it may use)."""
    t, layout = cfg.topology, Layout.of(cfg)
    usable, elastic = scaling.usable, scaling.elastic
    if elastic:
        low, high = cfg.elastic.dp_range(t.dp)
        skipped = [d for d in range(low, high + 1) if d not in usable and d % t.dp_multiple == 0]
        tr = cfg.train
        log.info(
            "elastic: %d to %d replicas of pp %d x tp %d; usable dp %s%s%s",
            scaling.min_dp,
            usable[-1],
            t.pp,
            t.tp,
            ", ".join(map(str, usable)),
            f" (dp {', '.join(map(str, skipped))} cannot split global batch {tr.global_batch_size} into "
            f"micro-batches of {tr.micro_batch_size}; the run uses the largest usable dp it can place)"
            if skipped
            else "",
            f"; HSDP: dp grows and shrinks by whole shard groups of {t.dp_multiple}" if t.dp_multiple > 1 else "",
        )
    log.info(
        "rayhybrid: %s ranks = dp %s x pp %d x tp %d (%s, %s, %s micro-batches of %d) on %s",
        "elastic" if elastic else layout.world_size,
        f"{scaling.min_dp}..{usable[-1]}" if elastic else t.dp,
        t.pp,
        t.tp,
        t.schedule if t.pp > 1 else "no pipeline",
        describe_data_parallel(t.dp, t.shard_group),
        "G/(dp x mb)" if elastic else layout.num_microbatches,
        cfg.train.micro_batch_size,
        "GPU" if use_gpu else "CPU",
    )
