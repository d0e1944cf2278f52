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

from rayhybrid.cluster.connect import connect, resolve_shape
from rayhybrid.cluster.group import WorkerGroup
from rayhybrid.cluster.placement import check_capacity
from rayhybrid.config.schema import Config
from rayhybrid.errors import RayHybridError

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
        self.history.append(metrics)
        self.metrics_file.write(json.dumps(metrics) + "\n")
        step, total = metrics["step"], self.cfg.train.steps
        if step % self.cfg.train.log_every == 0 or step == total or step == 1:
            self.bar.clear()
            log.info(
                "step %*d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s | %.2fs/step",
                len(str(total)), step, total, metrics["loss"], metrics["lr"], metrics["grad_norm"],
                f"{metrics['tokens_per_s']:,.0f}", metrics["step_time_s"],
            )
        eta = elapsed_s / max(1, len(self.history)) * (total - step)
        self.bar.update(step, metrics["loss"], eta)

    def summary(self, summary: dict) -> dict:
        self.bar.clear()
        self.metrics_file.close()
        path = self.dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
        return summary


class Controller:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.topology
        start = time.perf_counter()
        out = RunOutput(cfg)
        summary: dict = {
            "status": "failed",
            "steps": 0,
            "final_loss": None,
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
        }
        started_ray = False
        group = None
        try:
            started_ray = connect(cfg)
            shape = resolve_shape(cfg)
            check_capacity(shape, t.dp)
            group = WorkerGroup(cfg, shape)
            log.info(
                "rayhybrid: %d ranks = dp %d x pp %d x tp %d (%s, %s, %d micro-batches of %d) on %s",
                t.dp * t.pp * t.tp, t.dp, t.pp, t.tp, t.schedule if t.pp > 1 else "no pipeline",
                "FSDP2" if t.dp_shard else "replicated dp", summary["topology"]["num_microbatches"],
                cfg.train.micro_batch_size, "GPU" if shape.use_gpu else "CPU",
            )
            group.start()
            first = group.descriptions[0]
            summary.update(
                placement=group.placement(),
                backend=first["backend"],
                device=first["device"],
                params=first["model_params"],
                loss_floor=first["loss_floor"],
                startup_s=round(time.perf_counter() - start, 3),
            )
            log.info(
                "started %d workers in %.1fs; %s parameters; run dir %s%s",
                len(group.workers), summary["startup_s"], f"{summary['params']:,}", out.dir,
                f"; data loss floor {first['loss_floor']:.4f}" if first["loss_floor"] is not None else "",
            )
            train_start = time.perf_counter()
            for _ in range(cfg.train.steps):
                (metrics,) = group.train(1)
                out.step(metrics, time.perf_counter() - train_start)
            history = out.history
            summary.update(
                status="completed",
                steps=history[-1]["step"],
                initial_loss=history[0]["loss"],
                final_loss=history[-1]["loss"],
                consumed_samples=history[-1]["consumed_samples"],
                train_s=round(time.perf_counter() - train_start, 3),
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
            out.summary(summary)
            if group is not None:
                group.shutdown()
            if started_ray:
                ray.shutdown()
        floor = summary.get("loss_floor")
        log.info(
            "done: %d steps in %.1fs, loss %.4f -> %.4f%s; summary in %s",
            summary["steps"], summary["wall_s"], summary["initial_loss"], summary["final_loss"],
            f" (floor {floor:.4f})" if floor is not None else "", out.dir / "summary.json",
        )
        return summary


def _mean_throughput(history: list[dict]) -> float:
    """Tokens/s over the steps after the first (which includes warm-up)."""
    steady = history[1:] or history
    seconds = sum(m["step_time_s"] for m in steady)
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in steady)
    return round(tokens / seconds, 1) if seconds > 0 and not math.isnan(tokens) else 0.0

