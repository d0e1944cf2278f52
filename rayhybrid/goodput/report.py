"""goodput.json, goodput.png (`plot.py`) and the terminal table."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from rayhybrid.config.goodput import GoodputConfig
from rayhybrid.goodput.engine import CAUSES
from rayhybrid.goodput.plot import plot
from rayhybrid.goodput.simulate import Result

SHORT = {
    "detection": "detect",
    "restart": "restart",
    "redone_work": "redone",
    "checkpoint": "ckpt",
    "waiting_for_nodes": "waiting",
    "stopped": "stopped",
}


def output_dir(cfg: GoodputConfig) -> Path:
    """cfg.output_dir, or a new outputs/goodput/<date>/<time> under the current directory."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    base = Path.cwd() / "outputs" / "goodput" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def as_json(cfg: GoodputConfig, result: Result, measured: dict | None = None) -> dict:
    out = dataclasses.asdict(result)
    return {"settings": dataclasses.asdict(cfg), **({"from_run": measured} if measured else {}), **out}


def write(cfg: GoodputConfig, result: Result, measured: dict | None = None) -> Path:
    """Write goodput.json (with what from_run measured, if given) and goodput.png into the
    output directory; returns the folder."""
    folder = output_dir(cfg)
    os.makedirs(folder, exist_ok=True)
    (folder / "goodput.json").write_text(json.dumps(as_json(cfg, result, measured), indent=2) + "\n")
    plot(cfg, result, folder / "goodput.png")
    return folder


def table(cfg: GoodputConfig, result: Result) -> str:
    """The strategies side by side: effective time, interval, and GPU-hours lost by cause."""
    head = (
        f"{result.gpus_used} GPUs (dp {result.dp} x {cfg.replica_gpus}), {cfg.days:g} days, "
        f"failures={cfg.failures.preset}: job MTBF {result.job_mtbf_hours:.2f} h, "
        f"{result.failures_per_trace:.0f} failures per trace, {cfg.seeds} trace(s) from seed {cfg.seed}"
    )
    cols = "".join(f"{SHORT[c]:>10}" for c in CAUSES)
    c = cfg.costs
    costs = (
        f"costs{' from ' + cfg.from_run if cfg.from_run else ''}: detect {c.detect_s:.1f} s, restart "
        f"{c.restart_s:.1f} s, replace {c.replace_s:.1f} s, heal {c.heal_s:.1f} s, save {c.save_s:.2f} s, "
        f"step {c.step_s:.2f} s"
    )
    lines = [head, costs, f"{'strategy':<18}{'effective':>10}{'interval_s':>11}{'failures':>9}  GPU-hours lost:{cols}"]
    for name, s in result.strategies.items():
        lost = "".join(f"{s.gpu_hours_lost[c]:>10.0f}" for c in CAUSES)
        lines.append(
            f"{name:<18}{s.effective_time:>10.4f}{s.checkpoint_interval_s:>11.0f}{s.counts['failures']:>9.0f}"
            f"{'':>17}{lost}"
        )
    stopped = {name: s.stopped[0] for name, s in result.strategies.items() if s.stopped}
    lines += [f"{name} gave up: {why}" for name, why in stopped.items()]
    chosen = "restart_all" if result.strategy == "all" else result.strategy
    lines.append(f"recommended checkpoint.interval_s for {chosen}: {result.recommended_checkpoint_interval_s:.0f}")
    return "\n".join(lines)
