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
from rayhybrid.tune.plan import Record, TunePlan
from rayhybrid.tune.search import LinearMemoryModel, Trial

log = logging.getLogger("rayhybrid")

COLUMNS = (
    "trial",
    "purpose",
    "micro_batch_size",
    "num_microbatches",
    "global_batch_size",
    "activation_checkpointing",
    "peak_mb",
    "predicted_peak_mb",
    "budget_mb",
    "oom",
    "fits",
    "tokens_per_s",
    "error",
)


def _rows(cfg: Config, plan: TunePlan) -> list[dict]:
    rows = []
    for i, r in enumerate(plan.records, 1):
        p = r.point
        rows.append(
            {
                "trial": i,
                "purpose": r.purpose,
                "micro_batch_size": p.micro_batch_size,
                "num_microbatches": p.num_microbatches,
                "global_batch_size": cfg.topology.dp * p.micro_batch_size * p.num_microbatches,
                "activation_checkpointing": int(p.activation_checkpointing),
                "peak_mb": round(r.peak_mb, 4) if r.peaks_mb else "",
                "predicted_peak_mb": round(r.predicted_peak_mb, 4) if r.predicted_peak_mb is not None else "",
                "budget_mb": round(plan.budget_mb, 4),
                "oom": int(r.oom),
                "fits": int(r.fits(plan.budget_mb)),
                "tokens_per_s": round(r.tokens_per_s, 1) if r.tokens_per_s else "",
                "error": r.error,
            }
        )
    return rows


def training_overrides(cfg: Config, best: Record) -> list[str]:
    p = best.point
    return [
        f"train.micro_batch_size={p.micro_batch_size}",
        f"train.global_batch_size={cfg.topology.dp * p.micro_batch_size * p.num_microbatches}",
        f"train.activation_checkpointing={str(p.activation_checkpointing).lower()}",
    ]


def training_command(user_overrides: list[str], best_overrides: list[str]) -> str:
    """`python -m rayhybrid` with the user's overrides (less tune.* and the batch settings the
    search decided) and the best ones."""
    decided = {o.split("=", 1)[0] for o in best_overrides}
    kept = [o for o in user_overrides if not re.match(r"^\+*tune\.", o) and o.split("=", 1)[0] not in decided]
    return shlex.join(["python", "-m", "rayhybrid", *kept, *best_overrides])


def write(cfg: Config, plan: TunePlan, out: Path, wall_s: float, user_overrides: list[str] | None = None) -> dict:
    rows = _rows(cfg, plan)
    with open(out / "tune_results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    _print_table(rows)
    summary = {
        "budget_mb": plan.budget_mb,
        "trials": len(plan.records),
        "wall_s": round(wall_s, 2),
        "largest_micro_batch": {str(ac).lower(): s.best for ac, s in plan.searches.items()},
        "memory_trials": {str(ac).lower(): len(s.trials) for ac, s in plan.searches.items()},
        "best": None,
    }
    best = plan.best
    if best is not None:
        overrides = training_overrides(cfg, best)
        command = training_command(list(user_overrides or []), overrides)
        (out / "best.yaml").write_text(
            "# The fastest configuration that fitted the memory budget; train with:\n"
            f"#   {command}\n" + "".join(f"{o.replace('=', ': ', 1)}\n" for o in overrides)
        )
        summary["best"] = {
            "overrides": overrides,
            "command": command,
            "tokens_per_s": round(best.tokens_per_s, 1),
            "peak_mb": round(best.peak_mb, 4),
        }
        log.info(
            "best: %s (%.0f tok/s, peak %.2f MB of %.2f MB)",
            " ".join(overrides),
            best.tokens_per_s,
            best.peak_mb,
            plan.budget_mb,
        )
    plots = _plots(plan, out)
    summary["plots"] = plots
    (out / "tune_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("tuning done: %d trials in %.1fs; results in %s", len(plan.records), wall_s, out)
    if best is not None:
        print(f"\ntrain with:\n  {summary['best']['command']}", flush=True)
    return summary


def _print_table(rows: list[dict]) -> None:
    heads = ("trial", "purpose", "mb", "n_micro", "G", "AC", "peak_mb", "predicted", "oom", "fits", "tokens/s")
    keys = (
        "trial",
        "purpose",
        "micro_batch_size",
        "num_microbatches",
        "global_batch_size",
        "activation_checkpointing",
        "peak_mb",
        "predicted_peak_mb",
        "oom",
        "fits",
        "tokens_per_s",
    )
    table = [heads] + [tuple(str(row[k]) for k in keys) for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(heads))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in table]
    print("\n" + "\n".join(lines), flush=True)


def stage_of(key: str) -> str:
    """ "rank3/stage1/backward" -> "stage1"."""
    return next((part for part in key.split("/") if part.startswith("stage")), key)


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
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("peak memory per rank (MB)")
    ax.set_title("Peak memory per stage (highest rank and phase)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)
    written.append("memory.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = [r for r in plan.records if r.tokens_per_s]
    labels = [
        f"mb{r.point.micro_batch_size}x{r.point.num_microbatches}{' AC' if r.point.activation_checkpointing else ''}"
        for r in measured
    ]
    best = plan.best
    bar_colours = [
        "tab:green" if r is best else ("tab:blue" if r.fits(plan.budget_mb) else "tab:gray") for r in measured
    ]
    ax.bar(range(len(measured)), [r.tokens_per_s for r in measured], color=bar_colours)
    ax.set_xticks(range(len(measured)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("Throughput per trial (green: best that fits; grey: over budget)")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)
    written.append("throughput.png")
    return written
