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

SIMULATED_AS = {
    "detection": "detection",
    "teardown": "restart",
    "worker_init": "restart",
    "restore": "restart",
    "redone": "redone_work",
    "checkpoint": "checkpoint",
    "waiting_for_nodes": "waiting_for_nodes",
}
"""A run's measured causes of lost time (summary.json's goodput) -> the simulator's cause they
are part of. `productive` is the kept work; the others (start-up, data wait, bubble, exposed
communication, host overhead, evaluation, preemption drain) the simulator does not model."""

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


def comparison(goodput: dict, cfg: GoodputConfig, result: Result) -> dict:
    """The run's measured goodput beside the simulator's at the run's own size and wall time
    (`cfg`, `result`): effective time, and the lost seconds by the simulator's causes."""
    seconds = goodput["seconds"]
    measured = dict.fromkeys(CAUSES, 0.0)
    for cause, s in seconds.items():
        if cause in SIMULATED_AS:
            measured[SIMULATED_AS[cause]] += s
    not_simulated = {c: s for c, s in seconds.items() if c not in SIMULATED_AS and c != "productive"}
    simulated = {
        name: {
            "effective_time": round(r.effective_time, 6),
            "lost_s": {c: round(h * 3600.0 / result.gpus_used, 3) for c, h in r.gpu_hours_lost.items()},
        }
        for name, r in result.strategies.items()
    }
    return {
        "ranks": result.gpus_used,
        "replica_ranks": cfg.replica_gpus,
        "wall_s": goodput["wall_s"],
        "processes": goodput.get("processes"),
        "measured": {
            "effective_time": goodput["effective_time"],
            "lost_s": {c: round(s, 3) for c, s in measured.items()},
        },
        "not_simulated_s": {c: round(s, 3) for c, s in not_simulated.items()},
        "simulated": simulated,
    }


def comparison_table(c: dict) -> str:
    """`comparison` as the terminal shows it: measured beside each simulated strategy."""
    names = list(c["simulated"])
    lines = [
        (
            f"the run beside the simulator at its own size: {c['ranks']} ranks (replicas of {c['replica_ranks']}), "
            f"{c['wall_s']:.0f} s of wall time, {c['processes']} process(es)"
        ),
        f"{'':<20}{'measured':>12}" + "".join(f"{n:>18}" for n in names),
        f"{'effective time':<20}{c['measured']['effective_time']:>12.4f}"
        + "".join(f"{c['simulated'][n]['effective_time']:>18.4f}" for n in names),
        "seconds lost:",
    ]
    for cause in CAUSES:
        row = "".join(f"{c['simulated'][n]['lost_s'][cause]:>18.1f}" for n in names)
        lines.append(f"  {cause:<18}{c['measured']['lost_s'][cause]:>12.1f}{row}")
    lines.append(
        "  not simulated: " + (", ".join(f"{k} {v:.1f}" for k, v in c["not_simulated_s"].items() if v) or "none")
    )
    return "\n".join(lines)
