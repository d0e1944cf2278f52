"""goodput.png: the strategies side by side on the same failure trace(s): effective training
time (bars, the range over seeds as error bars) and GPU-hours lost by cause (stacked bars).
Drawn with matplotlib's Agg canvas, so no display and no global backend are needed."""

from __future__ import annotations

from pathlib import Path

from rayhybrid.config.goodput import GoodputConfig
from rayhybrid.goodput.engine import CAUSES
from rayhybrid.goodput.simulate import Result

LABELS = {
    "detection": "detection",
    "restart": "restart / heal / resize",
    "redone_work": "redone work",
    "checkpoint": "checkpoint blocking",
    "waiting_for_nodes": "waiting for nodes",
    "stopped": "stopped (gave up)",
}


def plot(cfg: GoodputConfig, result: Result, path: Path) -> Path:
    """Write the comparison to `path` (a PNG); returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    names = list(result.strategies)
    runs = list(result.strategies.values())
    x = range(len(names))
    fig = Figure(figsize=(13, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)

    effective = [s.effective_time for s in runs]
    below = [s.effective_time - s.effective_time_range[0] for s in runs]
    above = [s.effective_time_range[1] - s.effective_time for s in runs]
    bars = left.bar(x, effective, color="#4c72b0", yerr=[below, above], capsize=5, ecolor="black")
    left.bar_label(bars, labels=[f"{e:.3f}" for e in effective], label_type="center", color="white", fontsize=10)
    low = min(s.effective_time_range[0] for s in runs)
    left.set_ylim(max(0.0, low - 0.1 * (1.0 - low) - 0.02), 1.0)
    left.set_ylabel("effective training time (share of wall time kept)")
    spread = f", bars: range over {cfg.seeds} seeds" if cfg.seeds > 1 else ""
    left.set_title(f"Effective training time (mean{spread})")

    bottom = [0.0] * len(names)
    for cause in CAUSES:
        lost = [s.gpu_hours_lost[cause] for s in runs]
        if any(lost):
            right.bar(x, lost, bottom=bottom, label=LABELS[cause])
            bottom = [b + v for b, v in zip(bottom, lost, strict=True)]
    right.set_ylabel("GPU-hours lost (mean per trace)")
    right.set_title("GPU-hours lost by cause")
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    right.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))

    for ax in (left, right):
        ax.set_xticks(list(x), names, rotation=20, ha="right")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    source = f", costs from {Path(cfg.from_run).name}" if cfg.from_run else ""
    fig.suptitle(
        f"{result.gpus_used:,} GPUs, {cfg.days:g} days, failures={cfg.failures.preset} "
        f"(job MTBF {result.job_mtbf_hours:.2f} h, {result.failures_per_trace:.0f} failures per trace){source}"
    )
    fig.savefig(path, dpi=100)
    return path
