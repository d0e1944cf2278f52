"""Orchestration overhead: the same model and trainer code launched by torchrun and by rayhybrid
(Ray actors driven step by step), step times side by side."""

from __future__ import annotations

import statistics
from pathlib import Path

import common
from figures import fmt, header, table


def run(tmp: Path, quick: bool) -> dict:
    """The same model, parallelism and trainer code launched by torchrun (plain processes, no
    Ray) and by rayhybrid (Ray actors driven step by step): steady-state step time, as seen
    inside the ranks and as wall time between steps; runs alternate, A B B A ..., so a slow
    spell of the machine does not favour one (goal: within 5%)."""
    steps, pairs = (12, 2) if quick else (30, 3)
    topologies = ["dp2", "pp2"] if quick else ["dp2", "pp2", "tp2"]
    base = [*common.MODEL, "train.global_batch_size=16", "train.micro_batch_size=2"]
    rows = []
    for topo in topologies:
        ours: dict[str, list[float]] = {"step": [], "wall": [], "runs": []}
        theirs: dict[str, list[float]] = {"step": [], "wall": [], "runs": []}
        for i in range(2 * pairs):
            if i % 4 in (0, 3):  # A B B A: each launcher goes first as often as second
                _, records, _ = common.train(
                    [*base, *common.QUIET, f"+topology={topo}", f"train.steps={steps}"], tmp / f"overhead-{topo}-{i}"
                )
                ours["step"] += [r["step_time_s"] for r in records[2:]]
                ours["runs"].append(statistics.median(r["step_time_s"] for r in records[2:]))
                ours["wall"] += common.intervals([r["time"] for r in records[1:]])
                losses = [r["loss"] for r in records]
            else:
                r = common.baseline(
                    "torchrun_train.py",
                    [*base, f"+topology={topo}", "--steps", str(steps)],
                    launcher=common.torchrun(2),
                )
                theirs["step"] += r["step_times_s"][2:]
                theirs["runs"].append(statistics.median(r["step_times_s"][2:]))
                theirs["wall"] += common.intervals(r["step_walls"][1:])
                ref = r["losses"]
        # Each run's median in-step time, in the order run: how much the machine moved meanwhile.
        row = {
            "case": topo,
            "same_losses": _close(ref, losses),
            "rayhybrid_runs_s": ours["runs"],
            "torchrun_runs_s": theirs["runs"],
        }
        for key in ("step", "wall"):
            row[f"rayhybrid_{key}_s"] = statistics.median(ours[key])
            row[f"torchrun_{key}_s"] = statistics.median(theirs[key])
            row[f"{key}_ratio"] = row[f"rayhybrid_{key}_s"] / row[f"torchrun_{key}_s"]
        rows.append(row)
    return {"rows": rows, "steps": steps, "runs_each": pairs}


def _close(a: list[float], b: list[float]) -> bool:
    n = min(len(a), len(b))
    return n > 0 and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a[:n], b[:n]))


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
    out = (
        "## 2. Orchestration overhead: torchrun vs rayhybrid\n\nThe same model, parallelism and trainer code "
        "(`benchmarks/baselines/torchrun_train.py` runs rayhybrid's `Trainer` in processes torchrun starts); "
        "rayhybrid drives Ray actors one step at a time from its driver. Median over "
        f"{r.get('runs_each', '?')} runs of each launcher, alternating (A B B A), after two warm-up steps. "
        "*In-step*: the step as timed inside the ranks. *Step to step*: wall time between consecutive steps, "
        "which adds the launcher's own per-step cost (for rayhybrid, the call from the driver and the "
        "metrics record).\n\n"
    )
    out += header(r)
    if "rows" in r:
        out += table(
            [
                "topology",
                "torchrun in-step (s)",
                "rayhybrid in-step (s)",
                "ratio",
                "torchrun step to step (s)",
                "rayhybrid step to step (s)",
                "ratio",
                "same losses",
            ],
            [
                [
                    x["case"],
                    fmt(x["torchrun_step_s"], 3),
                    fmt(x["rayhybrid_step_s"], 3),
                    fmt(x["step_ratio"], 3),
                    fmt(x["torchrun_wall_s"], 3),
                    fmt(x["rayhybrid_wall_s"], 3),
                    fmt(x["wall_ratio"], 3),
                    "yes" if x["same_losses"] else "no",
                ]
                for x in r["rows"]
            ],
        )
        out += (
            "Each run's median in-step time (s), to show how far the machine itself moved between runs: "
            + "; ".join(
                f"{x['case']}: rayhybrid {' '.join(fmt(v, 3) for v in x.get('rayhybrid_runs_s', []))}, torchrun "
                f"{' '.join(fmt(v, 3) for v in x.get('torchrun_runs_s', []))}"
                for x in r["rows"]
            )
            + ".\n\n"
        )
    return out


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    return "rayhybrid/torchrun " + "  ".join(
        f"{x['case']}: in-step {x['step_ratio']:.3f}, step to step {x['wall_ratio']:.3f}" for x in r["rows"]
    )
