"""What a tuning run leaves in its directory: tune_results.csv, best.yaml, memory.png,
throughput.png, tune_summary.json, and a table and the training command on stdout."""

from __future__ import annotations

import csv
import json
import logging
import re
import shlex
from pathlib import Path

from rayhybrid.config.schema import Config
from rayhybrid.config.topology import shard_group_size
from rayhybrid.tune.layout import LayoutPlan
from rayhybrid.tune.memory_search import LinearMemoryModel, Trial
from rayhybrid.tune.microbatch import TunePlan
from rayhybrid.tune.space import TOPOLOGY_FIELDS, topology_fields
from rayhybrid.tune.trials import Record

log = logging.getLogger("rayhybrid")

COLUMNS = {
    "trial": "trial",
    "purpose": "purpose",
    "dp": "dp",
    "pp": "pp",
    "tp": "tp",
    "schedule": "schedule",
    "dp_shard": "shard",
    "micro_batch_size": "mb",
    "num_microbatches": "n_micro",
    "global_batch_size": "G",
    "activation_checkpointing": "AC",
    "offload_activations": "offload",
    "peak_mb": "peak_mb",
    "allocated_peak_mb": None,
    "planned_mb": "planned",
    "predicted_peak_mb": "fitted",
    "budget_mb": None,
    "oom": "oom",
    "fits": "fits",
    "tokens_per_s": "tokens/s",
    "tokens_per_cpu_s": "tokens/CPU-s",
    "error": None,
}
"""tune_results.csv's columns in order, each with its label in the printed table (None: the
CSV only). `peak_mb` is what limits a trial (on CUDA the caching allocator's reserved peak, on CPU
the tensor bytes), `allocated_peak_mb` the most allocated (CUDA) or the same (CPU). The printed table shows tokens/CPU-s only when trials are ranked by it."""


def _topology(cfg: Config, r: Record) -> dict:
    return dict(zip(TOPOLOGY_FIELDS, r.point.layout)) if r.point.layout else topology_fields(cfg)


def _rounded(x: float | None, digits: int = 4):
    return "" if x is None else round(x, digits)


def _rows(cfg: Config, plan) -> list[dict]:
    rows = []
    for i, r in enumerate(plan.records, 1):
        p, t = r.point, _topology(cfg, r)
        rows.append(
            {
                "trial": i,
                "purpose": r.purpose,
                "dp": t["dp"],
                "pp": t["pp"],
                "tp": t["tp"],
                "schedule": (t["schedule"] if t["pp"] > 1 else "-"),
                "dp_shard": shard_group_size(t["dp_shard"], t["dp"]),  # 1: replicated; dp: FSDP2; else HSDP
                "micro_batch_size": p.micro_batch_size,
                "num_microbatches": p.num_microbatches,
                "global_batch_size": t["dp"] * p.micro_batch_size * p.num_microbatches,
                "activation_checkpointing": int(p.activation_checkpointing),
                "offload_activations": int(p.offload_activations),
                "peak_mb": round(r.peak_mb, 4) if r.peaks_mb else "",
                "allocated_peak_mb": _rounded(r.allocated_mb),
                "planned_mb": _rounded(r.planned_mb),
                "predicted_peak_mb": _rounded(r.predicted_peak_mb),
                "budget_mb": round(plan.budget_mb, 4),
                "oom": int(r.oom),
                "fits": int(r.fits(plan.budget_mb)),
                "tokens_per_s": round(r.tokens_per_s, 1) if r.tokens_per_s else "",
                "tokens_per_cpu_s": round(r.tokens_per_cpu_s, 1) if r.tokens_per_cpu_s else "",
                "error": r.error,
            }
        )
    return rows


def training_overrides(cfg: Config, best: Record) -> list[str]:
    p = best.point
    t = _topology(cfg, best)
    layout = []
    if p.layout:
        layout = [f"topology.{k}={str(t[k]).lower() if isinstance(t[k], bool) else t[k]}" for k in TOPOLOGY_FIELDS]
    return [
        *layout,
        f"train.micro_batch_size={p.micro_batch_size}",
        f"train.global_batch_size={t['dp'] * p.micro_batch_size * p.num_microbatches}",
        f"train.activation_checkpointing={str(p.activation_checkpointing).lower()}",
        *(["train.offload_activations=true"] if p.offload_activations else []),
    ]


def training_command(user_overrides: list[str], best_overrides: list[str]) -> str:
    """`python -m rayhybrid` with the user's overrides (less tune.* and the settings the search
    decided) and the best ones."""
    decided = {o.split("=", 1)[0] for o in best_overrides}
    kept = [o for o in user_overrides if not re.match(r"^\+*tune\.", o) and o.split("=", 1)[0] not in decided]
    return shlex.join(["python", "-m", "rayhybrid", *kept, *best_overrides])


def planner_error(plan) -> dict | None:
    """How far the planner's memory predictions were from the measured peaks (relative)."""
    pairs = [(r.planned_mb, r.peak_mb) for r in plan.records if r.planned_mb is not None and r.peaks_mb]
    if not pairs:
        return None
    errors = [abs(planned / measured - 1) for planned, measured in pairs]
    return {"trials": len(pairs), "max": round(max(errors), 6), "mean": round(sum(errors) / len(errors), 6)}


def write(cfg: Config, plan, out: Path, wall_s: float, user_overrides: list[str] | None = None) -> dict:
    """Write the run directory's files, print the table and the training command; returns the
    summary (tune_summary.json)."""
    rows = _rows(cfg, plan)
    with open(out / "tune_results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    _print_table(rows, plan.metric)
    layout = isinstance(plan, LayoutPlan)
    summary = {
        "search": "layout" if layout else "micro_batch",
        "budget_mb": plan.budget_mb,
        "metric": plan.metric,
        "trials": len(plan.records),
        "wall_s": round(wall_s, 2),
        "planner_error": planner_error(plan),
        "best": None,
    }
    summary.update(_layout_summary(plan) if layout else _micro_batch_summary(cfg, plan))
    if plan.best is not None:
        summary.update(_best(cfg, plan, out, list(user_overrides or [])))
    summary["plots"] = _layout_plot(plan, out) if layout else _plots(plan, out)
    (out / "tune_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("tuning done: %d trials in %.1fs; results in %s", len(plan.records), wall_s, out)
    if plan.best is not None:
        print(f"\ntrain with:\n  {summary['best']['command']}", flush=True)
    return summary


def _layout_summary(plan: LayoutPlan) -> dict:
    return {
        "layouts": [list(x) for x in plan.layouts],
        "points": len(plan.planned),
        "pruned_by_planned_memory": plan.pruned,
    }


def _micro_batch_summary(cfg: Config, plan: TunePlan) -> dict:
    for p, mb in plan.skipped:
        log.info(
            "not run: micro-batch %d x %d%s, planned %.2f MB > budget",
            p.micro_batch_size,
            p.num_microbatches,
            " with checkpointing" if p.activation_checkpointing else "",
            mb,
        )
    return {
        "global_batch_size": plan.per_replica * cfg.topology.dp or None,
        "largest_micro_batch": {str(ac).lower(): s.best for ac, s in plan.searches.items()},
        "memory_trials": {str(ac).lower(): len(s.trials) for ac, s in plan.searches.items()},
        "skipped_over_planned_memory": [
            {**p.as_config("throughput"), "planned_mb": round(mb, 4)} for p, mb in plan.skipped
        ],
    }


def _best(cfg: Config, plan, out: Path, user_overrides: list[str]) -> dict:
    """The best trial: best.yaml, and the summary's "best" (and a layout search's "baseline")."""
    best = plan.best
    overrides = training_overrides(cfg, best)
    command = training_command(user_overrides, overrides)
    (out / "best.yaml").write_text(
        "# The fastest configuration that fitted the memory budget; train with:\n"
        f"#   {command}\n" + "".join(f"{o.replace('=', ': ', 1)}\n" for o in overrides)
    )
    summary: dict = {
        "best": {
            "overrides": overrides,
            "command": command,
            "tokens_per_s": round(best.tokens_per_s, 1),
            "tokens_per_cpu_s": round(best.tokens_per_cpu_s, 1),
            "peak_mb": round(best.peak_mb, 4),
            "planned_mb": _rounded(best.planned_mb),
        }
    }
    baseline = plan.baseline if isinstance(plan, LayoutPlan) else None
    if baseline is not None and baseline.fits(plan.budget_mb):
        summary["baseline"] = {
            "overrides": training_overrides(cfg, baseline),
            plan.metric: round(baseline.speed(plan.metric), 1),
            "speedup": round(best.speed(plan.metric) / baseline.speed(plan.metric), 3),
        }
    log.info(
        "best: %s (%.0f %s, peak %.2f MB of %.2f MB)",
        " ".join(overrides),
        best.speed(plan.metric),
        plan.metric.replace("tokens_per_", "tok/").replace("cpu_s", "CPU-s"),
        best.peak_mb,
        plan.budget_mb,
    )
    return summary


def _print_table(rows: list[dict], metric: str = "tokens_per_s") -> None:
    columns = {k: label for k, label in COLUMNS.items() if label and (k != "tokens_per_cpu_s" or metric == k)}
    if len({(r["dp"], r["pp"], r["tp"], r["schedule"], r["dp_shard"]) for r in rows}) <= 1:
        for key in ("dp", "pp", "tp", "schedule", "dp_shard"):  # one topology: it goes without saying
            columns.pop(key)
    table = [tuple(columns.values())] + [tuple(str(row[k]) for k in columns) for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in table]
    print("\n" + "\n".join(lines), flush=True)


def stage_of(key: str) -> str:
    """ "rank3/stage1/backward" -> "stage1"."""
    return next((part for part in key.split("/") if part.startswith("stage")), key)


def _layout_plot(plan: LayoutPlan, out: Path) -> list[str]:
    """memory.png: planned against measured peak per trial; throughput.png: each trial's speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    pairs = [(r.planned_mb, r.peak_mb) for r in plan.records if r.planned_mb is not None and r.peaks_mb]
    if pairs:
        xs, ys = zip(*pairs)
        ax.plot(xs, ys, "o")
        top = max(max(xs), max(ys), plan.budget_mb) * 1.05
        ax.plot([0, top], [0, top], "--", color="grey", label="measured = planned")
    ax.axhline(plan.budget_mb, color="red", linestyle="--", label=f"budget {plan.budget_mb:g} MB")
    _save(
        fig,
        ax,
        out / "memory.png",
        "planned peak (MB, busiest rank)",
        "measured peak (MB, busiest rank)",
        "Layout search: the planner's memory against the trials'",
    )
    _throughput_plot(plan, out)
    return ["memory.png", "throughput.png"]


def _save(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label, legend, write and close a memory plot."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _throughput_plot(plan, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = [r for r in plan.records if r.speed(plan.metric)]
    best = plan.best
    bar_colours = [
        "tab:green" if r is best else ("tab:blue" if r.fits(plan.budget_mb) else "tab:gray") for r in measured
    ]
    ax.bar(range(len(measured)), [r.speed(plan.metric) for r in measured], color=bar_colours)
    ax.set_xticks(range(len(measured)), [r.point.label() for r in measured], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("tokens per CPU-second (busiest rank)" if plan.metric == "tokens_per_cpu_s" else "tokens/s")
    ax.set_title("Throughput per trial (green: best that fits; grey: over budget)")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)


def _plots(plan: TunePlan, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    i = 0
    for ac, search in plan.searches.items():
        # Peak per stage (the highest of its ranks and phases) at each micro-batch measured.
        per_stage: dict[str, list[tuple[int, float]]] = {}
        for t in search.trials:
            for stage in sorted({stage_of(k) for k in t.peaks_mb}):
                peak = max(v for k, v in t.peaks_mb.items() if stage_of(k) == stage)
                per_stage.setdefault(stage, []).append((t.micro_batch_size, peak))
        top = max([t.micro_batch_size for t in search.trials] + [1])
        for stage, points in sorted(per_stage.items()):
            colour = colours[i % len(colours)]
            i += 1
            label = f"{stage}{' AC' if ac else ''}"
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, "o", color=colour, label=f"{label} measured")
            trials = [
                Trial(t.micro_batch_size, {k: v for k, v in t.peaks_mb.items() if stage_of(k) == stage}, t.oom)
                for t in search.trials
            ]
            if len({t.micro_batch_size for t in trials if t.peaks_mb}) >= 2:
                model = LinearMemoryModel.fit(trials)
                xs = range(int(top * 1.25) + 2)  # the highest of the stage's lines: piecewise linear
                ax.plot(list(xs), [model.peak(m) for m in xs], "-", color=colour, alpha=0.6, label=f"{label} fit")
    ax.axhline(plan.budget_mb, color="red", linestyle="--", label=f"budget {plan.budget_mb:g} MB")
    _save(
        fig,
        ax,
        out / "memory.png",
        "micro-batch size",
        "peak memory per rank (MB)",
        "Peak memory per stage (highest rank and phase)",
    )
    written.append("memory.png")

    _throughput_plot(plan, out)
    written.append("throughput.png")
    return written
