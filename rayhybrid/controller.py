"""The driver loop: connect, place, start, train, report. No torch.distributed here.

    summary = Controller(cfg).run()

Writes into `cfg.run_dir`: `metrics.jsonl` (one JSON object per optimizer step) and
`summary.json` (at the end, also when the run fails).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import ray

from rayhybrid import checkpoint_store
from rayhybrid.cluster.connect import connect, resolve_shape
from rayhybrid.cluster.group import WorkerGroup
from rayhybrid.cluster.placement import check_capacity
from rayhybrid.config.schema import Config
from rayhybrid.config.validate import usable_dps
from rayhybrid.errors import PlacementError, RayHybridError, WorkerError
from rayhybrid.observe import Observer

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
        self.text = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} loss {loss:.4f} eta {_duration(eta_s)}"
        self.draw()

    def draw(self) -> None:
        if self.enabled and self.text:
            self.stream.write("\r\033[K" + self.text)
            self.stream.flush()

    def clear(self) -> None:
        if self.enabled and self.text:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class RunOutput:
    """metrics.jsonl, step lines, progress bar and summary.json for one run directory."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.run_dir or ".").resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics_file = open(self.metrics_path, "a", buffering=1)
        self.bar = ProgressBar(cfg.train.steps)
        self.history: list[dict] = []

    def step(self, metrics: dict, elapsed_s: float) -> None:
        metrics["time"] = time.time()  # wall clock when the driver had the step (for step-to-step intervals)
        self.history.append(metrics)
        self.metrics_file.write(json.dumps(metrics) + "\n")
        step, total = metrics["step"], self.cfg.train.steps
        if step % self.cfg.train.log_every == 0 or step == total or step == 1:
            self.bar.clear()
            extra = "".join(
                f" | {name} {metrics[key]:.1%}" for key, name in (("mfu", "MFU"), ("bubble", "bubble"))
                if metrics.get(key) is not None
            )
            log.info(
                "step %*d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s | %.2fs/step%s",
                len(str(total)), step, total, metrics["loss"], metrics["lr"], metrics["grad_norm"],
                f"{metrics['tokens_per_s']:,.0f}", metrics["step_time_s"], extra,
            )
        eta = elapsed_s / max(1, len(self.history)) * (total - step)
        self.bar.update(step, metrics["loss"], eta)

    def event(self, record: dict) -> None:
        """A non-step record in metrics.jsonl (has an "event" key: resume, restart, checkpoint)."""
        self.metrics_file.write(json.dumps(record) + "\n")

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
        self.metrics_file = open(self.metrics_path, "a", buffering=1)

    def summary(self, summary: dict) -> dict:
        self.bar.clear()
        self.metrics_file.close()
        path = self.dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
        return summary


class RunFailed(RayHybridError):
    """The run cannot go on (restarts exhausted, a failure that repeats); the message names the
    cause and the last good checkpoint."""


class Controller:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.group: WorkerGroup | None = None
        self.elastic = cfg.elastic.enabled
        # An elastic run may use any of these dp values; a fixed one only topology.dp.
        self.usable = usable_dps(cfg) if self.elastic else [cfg.topology.dp]
        self.min_dp = min(d for d in self.usable if d >= cfg.elastic.min_dp) if self.elastic else None

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.topology
        start = time.perf_counter()
        out = RunOutput(cfg)
        ckpt_root = Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else out.dir / "checkpoints"
        summary: dict = {
            "status": "failed",
            "steps": 0,
            "final_loss": None,
            "restarts": 0,
            "topology": {
                **dataclasses.asdict(t),
                "world_size": t.dp * t.pp * t.tp,
                "num_microbatches": cfg.train.global_batch_size // (t.dp * cfg.train.micro_batch_size),
            },
            "model": dataclasses.asdict(cfg.model),
            "data": {"name": cfg.data.name, "seq_len": cfg.data.seq_len},
            "global_batch_size": cfg.train.global_batch_size,
            "micro_batch_size": cfg.train.micro_batch_size,
            "run_dir": str(out.dir),
            "checkpoint_dir": str(ckpt_root),
            "recoveries": [],
            "resizes": [],
        }
        started_ray = False
        self.observer = Observer(cfg, out.dir)
        try:
            started_ray = connect(cfg)
            shape = resolve_shape(cfg)
            check_capacity(shape, self.min_dp or t.dp)
            if self.elastic:
                self._announce_elastic()
            log.info(
                "rayhybrid: %s ranks = dp %s x pp %d x tp %d (%s, %s, %s micro-batches of %d) on %s",
                t.dp * t.pp * t.tp if not self.elastic else "elastic", t.dp if not self.elastic else
                f"{self.min_dp}..{self.usable[-1]}", t.pp, t.tp, t.schedule if t.pp > 1 else "no pipeline",
                "FSDP2" if t.dp_shard else "replicated dp",
                summary["topology"]["num_microbatches"] if not self.elastic else "G/(dp x mb)",
                cfg.train.micro_batch_size, "GPU" if shape.use_gpu else "CPU",
            )
            self._train(shape, out, ckpt_root, summary, start)
            history = out.history
            summary.update(
                status="completed",
                steps=history[-1]["step"] if history else summary.get("resumed_step", 0),
                initial_loss=history[0]["loss"] if history else None,
                final_loss=history[-1]["loss"] if history else None,
                consumed_samples=history[-1]["consumed_samples"] if history else None,
                mean_tokens_per_s=_mean_throughput(history),
            )
        except KeyboardInterrupt:
            summary.update(status="interrupted", error="interrupted by the user")
            raise
        except RayHybridError as err:
            summary.update(status="failed", error=str(err))
            raise
        finally:
            if out.history and summary["status"] != "completed":
                summary.update(steps=out.history[-1]["step"], final_loss=out.history[-1]["loss"])
            summary["wall_s"] = round(time.perf_counter() - start, 3)
            self.observer.close(summary, out.history)
            out.summary(summary)
            if self.group is not None:
                self.group.shutdown(graceful=summary["status"] == "completed")
            if started_ray:
                ray.shutdown()
        floor = summary.get("loss_floor")
        log.info(
            "done: %d steps in %.1fs, loss %s -> %s%s%s; summary in %s",
            summary["steps"], summary["wall_s"], _fmt(summary["initial_loss"]), _fmt(summary["final_loss"]),
            f" (floor {floor:.4f})" if floor is not None else "",
            f", {summary['restarts']} restart(s)" if summary["restarts"] else "", out.dir / "summary.json",
        )
        return summary

    def _announce_elastic(self) -> None:
        low, high = self.cfg.elastic.dp_range(self.cfg.topology.dp)
        skipped = [d for d in range(low, high + 1) if d not in self.usable]
        tr = self.cfg.train
        log.info(
            "elastic: %d to %d replicas of pp %d x tp %d; usable dp %s%s", self.min_dp, self.usable[-1],
            self.cfg.topology.pp, self.cfg.topology.tp, ", ".join(map(str, self.usable)),
            f" (dp {', '.join(map(str, skipped))} cannot split global batch {tr.global_batch_size} into micro-batches "
            f"of {tr.micro_batch_size}; the run uses the largest usable dp it can place)" if skipped else "",
        )

    def _start(self, shape, ckpt_root: Path, out: RunOutput, summary: dict) -> tuple[int, dict]:
        """Place and start a worker group (or, after a failure, recover the one there is, an
        elastic one shrinking when replicas are gone), restore the latest checkpoint;
        (step, timings)."""
        timings = {}
        if self.group is None:
            self.group = WorkerGroup(self.cfg, shape, self.usable)
            self.group.start(self.min_dp, timings)
        else:
            dp_before = self.group.dp
            try:
                timings["replaced_ranks"] = self.group.recover(timings, self.min_dp)
            except PlacementError as err:  # the cluster lost capacity mid-run: not a config error
                good = checkpoint_store.latest(ckpt_root)
                raise RunFailed(
                    f"{err.message}; last good checkpoint: {good.path if good else 'none'}"
                ) from None
            if self.group.dp != dp_before:
                timings["resized"] = (dp_before, self.group.dp)
        return self._restore(ckpt_root, out, summary, timings), timings

    def _restore(self, ckpt_root: Path, out: RunOutput, summary: dict, timings: dict) -> int:
        """Load the latest checkpoint into the group (if any); returns its step."""
        ckpt = checkpoint_store.latest(ckpt_root)
        step = 0
        if ckpt is None:
            out.rewind(0)  # a failure before the first checkpoint: every step is trained again
        else:
            mark = time.perf_counter()
            step = self.group.load(str(ckpt.path), ckpt.meta)
            timings["restore_s"] = time.perf_counter() - mark + timings.get("restore_s", 0.0)
            out.rewind(step)
            written = ckpt.meta["topology"]
            log.info(
                "resuming from %s (step %d, %d samples consumed%s)", ckpt.path, step, ckpt.meta["consumed_samples"],
                "" if all(written[k] == getattr(self.group.cfg.topology, k) for k in ("dp", "pp", "tp"))
                else f"; written under dp{written['dp']}_pp{written['pp']}_tp{written['tp']}, resharded",
            )
            out.event({"event": "resume", "step": step, "checkpoint": str(ckpt.path)})
            summary.setdefault("resumed_from", str(ckpt.path))
            summary["resumed_step"] = step
        workers = [{**p, "pid": info.pid} for p, info in zip(self.group.placement(), self.group.infos)]
        (out.dir / "workers.json").write_text(json.dumps(workers, indent=1) + "\n")
        first = self.group.descriptions[0]
        t = self.group.cfg.topology  # an elastic run's current dp
        summary["topology"].update(
            dp=t.dp, world_size=t.dp * t.pp * t.tp,
            num_microbatches=self.cfg.train.global_batch_size // (t.dp * self.cfg.train.micro_batch_size),
        )
        self.observer.started(self.group.placement(), first["device_name"])
        summary.update(
            placement=self.group.placement(),
            device_name=first["device_name"],
            backend=first["backend"],
            device=first["device"],
            params=first["model_params"],
            loss_floor=first["loss_floor"],
        )
        return step

    def _train(self, shape, out: RunOutput, ckpt_root: Path, summary: dict, start: float) -> None:
        cfg = self.cfg
        every, steps = cfg.checkpoint.every, cfg.train.steps
        failures: list[int] = []
        recovery: dict | None = None
        growth: dict | None = None
        last_progress = time.perf_counter()
        step = 0
        while True:
            try:
                step, timings = self._start(shape, ckpt_root, out, summary)
                if recovery is None:
                    summary["startup_s"] = round(time.perf_counter() - start, 3)
                    log.info(
                        "started %d workers in %.1fs; %s parameters; run dir %s%s",
                        len(self.group.workers), summary["startup_s"], f"{summary['params']:,}", out.dir,
                        f"; data loss floor {summary['loss_floor']:.4f}" if summary["loss_floor"] is not None else "",
                    )
                train_start = time.perf_counter()
                while step < steps:
                    (metrics,) = self.group.train(1, timeout_s=cfg.fault.step_timeout_s)
                    metrics = self.observer.step(metrics)
                    step = metrics["step"]
                    last_progress = time.perf_counter()
                    if recovery is not None:
                        resized = timings.pop("resized", None)
                        recovery.update(timings, first_step_s=metrics["step_time_s"])
                        recovery["total_s"] = last_progress - recovery.pop("_failed_at") + recovery["detect_s"]
                        self._recovered(recovery, out, summary)
                        if resized:
                            self._resized(out, summary, step - 1, *resized, f"replica lost ({recovery['cause']})",
                                          {**recovery, "resize_s": recovery["total_s"]})
                        recovery = None
                    if growth is not None:
                        growth.update(timings, first_step_s=metrics["step_time_s"])
                        growth["resize_s"] = last_progress - growth.pop("_last_step_at")
                        self._resized(out, summary, step - 1, growth.pop("from"), self.group.dp, growth.pop("cause"), growth)
                        growth = None
                    out.step(metrics, time.perf_counter() - train_start)
                    if every and (step % every == 0 or step == steps):
                        saved = self.group.save(str(ckpt_root), cfg.checkpoint.keep, timeout_s=cfg.fault.step_timeout_s)
                        out.event({"event": "checkpoint", "step": step, "path": saved["path"],
                                   "save_s": round(saved["save_s"], 3)})
                        summary["last_checkpoint"] = saved["path"]
                        if self.elastic and step < steps:
                            growth, timings = self._grow(ckpt_root, out, summary, step, last_progress, saved["save_s"])
                summary["train_s"] = round(time.perf_counter() - train_start, 3)
                return
            except WorkerError as err:
                growth = None
                failed_at = time.perf_counter()
                good = checkpoint_store.latest(ckpt_root)
                where = f"last good checkpoint: {good.path} (step {good.step})" if good else "no checkpoint yet"
                failures.append(step + 1)
                log.warning("step %d failed: %s", step + 1, err)
                if summary["restarts"] >= cfg.fault.max_restarts:
                    raise RunFailed(
                        f"giving up after {summary['restarts']} restart(s) (fault.max_restarts={cfg.fault.max_restarts}): "
                        f"{err}; {where}"
                    ) from None
                if failures.count(step + 1) > 1:
                    raise RunFailed(f"step {step + 1} failed twice, the same way it will again: {err}; {where}") from None
                summary["restarts"] += 1
                recovery = {
                    "restart": summary["restarts"], "failed_step": step + 1, "cause": str(err),
                    "resume_step": good.step if good else 0,
                    "detect_s": failed_at - last_progress if recovery is None else 0.0,
                    "_failed_at": failed_at,
                }
                log.warning(
                    "restart %d/%d: replacing the failed workers and restarting from %s",
                    summary["restarts"], cfg.fault.max_restarts, good.path if good else "the beginning",
                )

    def _grow(self, ckpt_root: Path, out: RunOutput, summary: dict, step: int, last_step_at: float, save_s: float):
        """At a checkpoint boundary (just saved): when more replicas are placed than in use and
        a larger usable dp fits them, resize and restore the checkpoint. Returns (growth record,
        timings) for the first step after, or (None, {})."""
        group = self.group
        spare = [slot for slot in group.placed_slots() if slot not in group.active]
        new_dp = group.fit(group.dp + len(spare))
        if new_dp <= group.dp:
            return None, {}
        old_dp = group.dp
        cause = f"{len(spare)} more replica(s) placed"
        log.warning("resize dp %d -> %d at step %d: %s; restarting from the checkpoint just written",
                    old_dp, new_dp, step, cause)
        timings = {"save_s": save_s}
        group.resize(group.active + spare[: new_dp - old_dp], timings)
        self._restore(ckpt_root, out, summary, timings)
        return {"from": old_dp, "cause": cause, "_last_step_at": last_step_at}, timings

    def _resized(self, out: RunOutput, summary: dict, step: int, old: int, new: int, cause: str, timing: dict) -> None:
        keys = ("save_s", "teardown_s", "place_s", "init_s", "restore_s", "first_step_s", "resize_s")
        # `step`: the last step trained before the resize took effect (the checkpoint resumed from).
        record = {"event": "resize", "step": step, "from_dp": old, "to_dp": new, "cause": cause,
                  **{k: round(timing[k], 3) for k in keys if k in timing}}
        summary["resizes"].append(record)
        out.event(record)
        log.warning(
            "resized dp %d -> %d (%s): %.1fs from the last step before to the first step after", old, new, cause,
            timing.get("resize_s", 0.0),
        )

    def _recovered(self, recovery: dict, out: RunOutput, summary: dict) -> None:
        rounded = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in recovery.items()}
        summary["recoveries"].append(rounded)
        out.event({"event": "restart", **rounded})
        log.warning(
            "recovered from the failure at step %d in %.1fs (teardown %.1fs, place %.1fs, init %.1fs, restore %.1fs, "
            "first step %.1fs)", recovery["failed_step"], recovery["total_s"], recovery.get("teardown_s", 0.0),
            recovery.get("place_s", 0.0), recovery.get("init_s", 0.0), recovery.get("restore_s", 0.0),
            recovery["first_step_s"],
        )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _mean_throughput(history: list[dict]) -> float:
    """Tokens/s over the steps after the first (which includes warm-up)."""
    steady = history[1:] or history
    seconds = sum(m["step_time_s"] for m in steady)
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in steady)
    return round(tokens / seconds, 1) if seconds > 0 and not math.isnan(tokens) else 0.0

