"""Pipeline schedules: measured bubble, saved activations and peak memory per pipeline rank,
next to the formulas and to what `python -m rayhybrid.plan` predicts."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import common
from figures import fmt, header, table


def run(tmp: Path, quick: bool) -> dict:
    """Measured bubble fraction, peak memory and peak saved activations per pipeline rank of the
    schedules, pp2 x 4 micro-batches, next to theory: the bubble formula, and the memory
    `python -m rayhybrid.plan` predicts by walking the schedule's order (rayhybrid.plan.estimate)."""
    sys.path.insert(0, str(common.ROOT))
    from rayhybrid.plan.estimate import bubble_fraction
    from rayhybrid.plan.peak_memory import rank_memory
    from rayhybrid.preflight import load_config

    cases = {
        "gpipe": [],
        "1f1b": [],
        "interleaved_1f1b": ["topology.stages_per_rank=2"],
        "interleaved_zb": ["topology.stages_per_rank=2"],
        "zbv": ["topology.stages_per_rank=2"],
    }
    if quick:
        cases.pop("interleaved_zb")
    m, pp = 4, 2
    rows = []
    for name, extra in cases.items():
        overrides = [
            "+topology=pp2",
            f"topology.schedule={name}",
            *extra,
            *common.MODEL,
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            f"train.steps={5 if quick else 10}",
            "metrics.memory=true",
            *common.QUIET,
        ]
        _, records, _ = common.train(overrides, tmp / f"sched-{name}")
        cfg = load_config(overrides)
        theory, formula = bubble_fraction(name, pp, m, 2 if extra else 1)
        plan = [rank_memory(cfg, r) for r in range(pp)]
        last = records[-1]  # "rank<r>/stage<s>/<phase>": MB, once the optimizer state exists

        def per_rank(metric: str, last=last) -> list[float]:
            return [max(v for k, v in last[metric].items() if k.startswith(f"rank{r}/")) for r in range(pp)]

        rows.append(
            {
                "schedule": name,
                "bubble": statistics.median(r["bubble"] for r in records[1:]),
                "theory_bubble": theory,
                "formula": formula,
                "activation_mb": per_rank("activation_mb"),
                "plan_activation_mb": [p.saved_peak / 2**20 for p in plan],
                "in_flight": [{str(k): v for k, v in p.max_in_flight.items()} for p in plan],
                "peak_mb": per_rank("peak_mb"),
                "plan_peak_mb": [p.total / 2**20 for p in plan],
                "step_s": common.steady_step_s(records),
            }
        )
    return {"rows": rows, "micro_batches": m}


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
    out = (
        f"## 6. Pipeline schedules\n\npp2, {r.get('micro_batches')} micro-batches of 2 (interleaved and ZB-V: 2 "
        "stages per rank). *Bubble*: the idle share of the schedule's time, measured from each rank's chunk "
        "timings (median of steady steps, mean over ranks), next to the formula for equal stage times. "
        "*Activations*: the most bytes saved for backward on each pipeline rank during the step (CPU tensor "
        "accounting; on the last stage this includes every micro-batch's logits, which torch's schedules keep), "
        "next to theory: the most micro-batches in flight per stage in the schedule's order x what one "
        "micro-batch saves. *Peak*: each rank's whole peak next to what `python -m rayhybrid.plan` predicts.\n\n"
    )
    out += header(r)
    if "rows" in r:

        def mbs(xs):
            return " / ".join(fmt(v, 1) for v in xs)

        out += table(
            [
                "schedule",
                "bubble",
                "theory",
                "activations MB per rank",
                "theory",
                "in flight (stage: n)",
                "peak MB per rank",
                "plan's peak",
                "step (s)",
            ],
            [
                [
                    x["schedule"],
                    fmt(x["bubble"], pct=True),
                    fmt(x["theory_bubble"], pct=True),
                    mbs(x["activation_mb"]),
                    mbs(x["plan_activation_mb"]),
                    " / ".join(", ".join(f"{k}: {v}" for k, v in d.items()) for d in x["in_flight"]),
                    mbs(x["peak_mb"]),
                    mbs(x["plan_peak_mb"]),
                    fmt(x["step_s"], 3),
                ]
                for x in r["rows"]
            ],
        )
        out += (
            "The interleaved and zero-bubble schedules cut each rank's work into twice as many chunks, so what "
            "every chunk costs whatever its size (a gloo send or receive, see the all-reduce table above; "
            "torch's Python dispatch) weighs twice as much; on this machine that takes back most of what the "
            "formulas promise. That explanation is ours and not broken down further here.\n\n"
        )
        out += (
            "Bubble theory: "
            + "; ".join(dict.fromkeys(f"{x['schedule']}: {x['formula']}" for x in r["rows"]))
            + ".\n\n"
        )
    return out


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    return "bubble " + "  ".join(
        f"{x['schedule']} {fmt(x['bubble'], pct=True)} (theory {fmt(x['theory_bubble'], pct=True)})" for x in r["rows"]
    )
