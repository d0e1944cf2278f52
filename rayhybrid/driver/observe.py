"""What the driver adds to a run's outputs: FLOP/s and MFU per step, trace.json and loss.png
with the held-out loss (the step metrics themselves come from the workers; TensorBoard's event
files are a tracker's, rayhybrid.tracking).

    observer = Observer(cfg, run_dir)             # a reporter: runlog.attach(observer)
    observer.after_workers_start(placement, description)   # once the workers describe themselves
    metrics = observer.before_step(metrics)       # adds tflops/mfu, keeps trace spans aside
    observer.before_close(summary, history)       # trace.json, loss.png, summary figures, the
                                                  # MFU split's table in the log
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rayhybrid.config.schema import Config
from rayhybrid.driver.reporting import Reporter
from rayhybrid.models.registry import get_spec
from rayhybrid.tracking import tensorboard_dir
from rayhybrid.trainer.results import SPLIT_PARTS

if TYPE_CHECKING:
    from rayhybrid.driver.records import StepMetrics

log = logging.getLogger("rayhybrid")

# Dense peak TFLOP/s of one device (vendor datasheets, SXM parts unless named): (16-bit tensor
# cores, float32). Float32 training uses the second: PyTorch's default matmul precision does not
# use TF32. The first match in this order wins.
PEAK_TFLOPS = (
    ("H100 PCIe", (756.0, 51.0)),
    ("H200", (989.0, 67.0)),
    ("H100", (989.0, 67.0)),
    ("A100", (312.0, 19.5)),
    ("L40S", (362.0, 91.6)),
    ("L4", (121.0, 30.3)),
    ("A10", (125.0, 31.2)),
    ("V100", (125.0, 15.7)),
)


def device_peak_tflops(cfg: Config, device_name: str) -> float | None:
    """`metrics.peak_tflops` if set, else the table's figure for the device and dtype."""
    if cfg.metrics.peak_tflops > 0:
        return cfg.metrics.peak_tflops
    for name, (half, single) in PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            return half if cfg.train.dtype == "bfloat16" else single
    return None


class Observer(Reporter):
    """The run log's reporter of figures: FLOP/s and MFU on each step, and at the end the
    summary's figures, trace.json and loss.png."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg = cfg
        self.dir = run_dir
        self.flops_per_token = get_spec(cfg.model).flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak: float | None = None
        self.ranks: list[dict] = []
        self.trace: list[dict] = []

    def after_workers_start(self, placement: list[dict], description: dict) -> None:
        self.ranks = [{k: p[k] for k in ("rank", "dp", "pp", "tp")} for p in placement]
        self.peak = device_peak_tflops(self.cfg, description["device_name"])

    def before_step(self, metrics: StepMetrics) -> StepMetrics:
        """Adds `tflops` (achieved by the whole job: model FLOPs per token x tokens / step time)
        and `mfu` (that over the peak of all its devices, when the peak is known)."""
        metrics = dict(metrics)
        spans = metrics.pop("trace", None)
        if spans:
            self.trace.extend(spans)
        world = metrics["dp"] * metrics["pp"] * metrics["tp"]
        metrics["tflops"] = self.flops_per_token * metrics["tokens_per_s"] / 1e12
        metrics["mfu"] = metrics["tflops"] / (self.peak * world) if self.peak else None
        return metrics

    def before_close(self, summary: dict, history: list[dict]) -> None:
        steady = history[1:] or history
        if steady:
            summary["mean_tflops"] = round(sum(m["tflops"] for m in steady) / len(steady), 6)
            mfu = [m["mfu"] for m in steady if m.get("mfu") is not None]
            summary["mfu"] = round(sum(mfu) / len(mfu), 6) if mfu else None
            bubbles = [m["bubble"] for m in steady if m.get("bubble") is not None]
            summary["mean_bubble"] = round(sum(bubbles) / len(bubbles), 4) if bubbles else None
            for name in ("peak_mb", "activation_mb", "reserved_mb"):
                if any(m.get(name) for m in history):
                    summary[f"{name}_by_stage"] = _by_stage([m[name] for m in history if m.get(name)])
            if split := mfu_split(steady, summary["mfu"], first_left_out=len(history) > 1):
                summary["mfu_split"] = split
                log.info("%s", split_table(split))
        summary["flops_per_token"] = self.flops_per_token
        summary["peak_tflops_per_device"] = self.peak
        if self.trace:
            from rayhybrid.trainer.timeline import chrome_trace

            path = self.dir / "trace.json"
            path.write_text(json.dumps(chrome_trace(self.trace, self.ranks)))
            summary["trace"] = str(path)
        if history:
            summary["loss_plot"] = str(loss_plot(history, summary.get("loss_floor"), self.dir / "loss.png"))
        if self.cfg.metrics.tensorboard:  # where the tracker writes them (it closes after summary.json)
            summary["tensorboard"] = str(tensorboard_dir(self.dir))


PART_NAMES = {
    "compute_s": "compute",
    "comm_dp_s": "comm dp",
    "comm_tp_s": "comm tp",
    "comm_pp_s": "comm pp",
    "bubble_s": "bubble",
    "data_wait_s": "data wait",
    "host_s": "host",
}
"""The table's rows, in its order (docs/observability.md, "The MFU split")."""


def mfu_split(steps: list[dict], mfu: float | None, first_left_out: bool = True) -> dict | None:
    """The steps' split (their records' `split`) summed: seconds and shares by part, with the
    run's MFU and what it is over the compute time alone. None: no step has a split.
    `first_left_out`: `steps` are the kept steps after the first (its start-up is not a step's)."""
    splits = [m["split"] for m in steps if m.get("split")]
    if not splits:
        return None
    seconds = {part: sum(s.get(part, 0.0) for s in splits) for part in SPLIT_PARTS}
    total = sum(seconds.values())
    shares = {part: s / total if total > 0 else 0.0 for part, s in seconds.items()}
    compute = shares["compute_s"]
    return {
        "steps": len(splits),
        "first_step_left_out": first_left_out,
        "seconds": {part: round(s, 6) for part, s in seconds.items()},
        "shares": {part: round(share, 4) for part, share in shares.items()},
        "mfu": mfu,
        "mfu_of_compute": round(mfu / compute, 6) if mfu is not None and compute > 0 else None,
    }


def split_table(split: dict) -> str:
    """`mfu_split` as the table the log shows at the end of a run."""
    total = sum(split["seconds"].values())
    which = " after the first" if split.get("first_step_left_out") else ""
    lines = [f"MFU split over {split['steps']} kept steps{which} ({total:.3f} s):"]
    lines += [f"  {'part':<10}{'seconds':>11}{'share':>8}"]
    for part, name in PART_NAMES.items():
        lines.append(f"  {name:<10}{split['seconds'][part]:>11.3f}{split['shares'][part]:>8.1%}")
    if split["mfu"] is None:
        lines.append("  MFU       n/a (no known device peak: set metrics.peak_tflops)")
    else:
        alone = split["mfu_of_compute"]
        lines.append(
            f"  MFU       {split['mfu']:.4f}" + (f" ({alone:.4f} over the compute time alone)" if alone else "")
        )
    return "\n".join(lines)


def _by_stage(steps: list[dict[str, float]]) -> dict[str, float]:
    """The highest figure of each stage over steps, ranks and phases ("rank<r>/stage<s>/<phase>")."""
    by_stage: dict[str, float] = {}
    for step in steps:
        for key, mb in step.items():
            stage = key.split("/")[1]
            by_stage[stage] = max(mb, by_stage.get(stage, 0.0))
    return {k: round(v, 3) for k, v in sorted(by_stage.items())}


def loss_plot(history: list[dict], floor: float | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in history], [m["loss"] for m in history], label="loss")
    evaluated = [m for m in history if m.get("val_loss") is not None]
    if evaluated:
        ax.plot(
            [m["step"] for m in evaluated],
            [m["val_loss"] for m in evaluated],
            marker="o",
            label="val_loss (held-out)",
        )
    if floor is not None:
        ax.axhline(floor, color="gray", linestyle="--", label=f"data's loss floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
