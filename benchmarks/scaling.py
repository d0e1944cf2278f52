"""Scaling on this machine: dp2, pp2 and tp2 against one rank, and what bounds them here (the
same one-rank job twice at once; the all-reduce's cost)."""

from __future__ import annotations

import statistics
from pathlib import Path

import common
from figures import fmt, header, size, table


def run(tmp: Path, quick: bool) -> dict:
    """Throughput of dp2, pp2 (1F1B, 8 micro-batches) and tp2 relative to one rank, same
    global batch (16) and micro-batch (2); with what bounds them on this machine: the same
    one-rank job run twice at once (no communication at all), and the all-reduce's cost."""
    steps, rounds = (8, 1) if quick else (16, 2)
    base = [
        *common.MODEL,
        *common.QUIET,
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
        f"train.steps={steps}",
    ]
    cases = {"1 rank": [], "dp2": ["+topology=dp2"], "pp2 (1F1B, 8 mb)": ["+topology=pp2"], "tp2": ["+topology=tp2"]}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):  # rounds interleave the cases, so a slow spell of the machine hits all of them
        for i, (name, extra) in enumerate(cases.items()):
            _, records, _ = common.train([*base, *extra], tmp / f"scaling-{r}-{i}")
            times[name] += [x["step_time_s"] for x in records[2:]]
    one = statistics.median(times["1 rank"])
    rows = [
        {"case": name, "step_s": statistics.median(t), "speedup": one / statistics.median(t)}
        for name, t in times.items()
    ]
    # The ceiling: two independent one-rank jobs at once, against one alone (the same launcher).
    args = [*common.MODEL, "train.global_batch_size=16", "train.micro_batch_size=2", "--steps", str(steps)]
    alone = common.baseline("torchrun_train.py", args, launcher=common.torchrun(1))
    pair = common.baselines_at_once([("torchrun_train.py", args, common.torchrun(1))] * 2)
    alone_s = statistics.median(alone["step_times_s"][2:])
    pair_s = statistics.median([t for r in pair for t in r["step_times_s"][2:]])
    allreduce = common.baseline("allreduce.py", [], launcher=common.torchrun(2))
    return {
        "rows": rows,
        "ceiling": 2 * alone_s / pair_s,
        "alone_step_s": alone_s,
        "pair_step_s": pair_s,
        "allreduce": allreduce["rows"],
        "backend": allreduce["backend"],
        "steps": steps,
        "rounds": rounds,
    }


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
    out = (
        "## 1. Scaling on this machine\n\nThroughput relative to one rank: global batch 16 in micro-batches of "
        "2, median step time after two warm-up steps. The physical limit on 2 cores is 2.0x.\n\n"
    )
    out += header(r)
    if "rows" not in r:
        return out
    out += table(
        ["case", "step (s)", "speed-up"], [[x["case"], fmt(x["step_s"], 3), fmt(x["speedup"]) + "x"] for x in r["rows"]]
    )
    out += (
        f"What bounds these here: the same one-rank job run twice at once, with no communication at all, "
        f"takes {fmt(r['pair_step_s'], 3)} s a step against {fmt(r['alone_step_s'], 3)} s alone, so two ranks can "
        f"reach at most **{fmt(r['ceiling'])}x** on this machine (shared caches and memory bandwidth). "
        f"The {r['backend']} all-reduce between two processes costs:\n\n"
    )
    out += table(
        ["size", "time (ms)", "MB/s"],
        [[size(x["bytes"]), fmt(x["ms"]), f"{x['mb_per_s']:.0f}"] for x in r["allreduce"]],
    )
    out += (
        "dp2 all-reduces the gradients once a step; pp2 sends a micro-batch's activations (128 KB here) a "
        "few dozen times a step; tp2 all-reduces 256 KB activations twice per block in forward and again in "
        "backward, about 150 times a step, each in the critical path, plus DTensor's per-operator cost on "
        "matrices of 256 columns. On GPUs with NVLink the same all-reduce takes microseconds; on this "
        "machine tensor parallelism cannot pay off, and rayhybrid keeps it inside a node for that reason.\n\n"
    )
    return out


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    return "  ".join(f"{x['case']}: {x['speedup']:.2f}x" for x in r["rows"]) + f"  (ceiling here {r['ceiling']:.2f}x)"
