"""Batch-size search: rayhybrid's search for the largest micro-batch that fits against a
Lightning-style doubling and bisection, on the same trial runner."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import common
from figures import fmt, header, table


def run(tmp: Path, quick: bool) -> dict:
    """Trials and wall time to find the largest micro-batch that fits, on the same trial runner
    (real trainer runs, pp2, the CPU budget): rayhybrid's search against a Lightning-style
    doubling + binary search (BatchSizeFinder's `binsearch`, starting at 2)."""
    import ray

    sys.path.insert(0, str(common.ROOT))
    from rayhybrid.cluster.connect import connect, resolve_shape
    from rayhybrid.preflight import load_config
    from rayhybrid.tune import space
    from rayhybrid.tune.memory_search import MicroBatchSearch
    from rayhybrid.tune.run import TrialHost, base_point
    from rayhybrid.tune.trials import peaks_from_result

    budgets = (12.0,) if quick else (12.0, 40.0)
    rows = []
    connect(load_config(["+topology=pp2"]))
    try:
        for budget in budgets:
            cfg = load_config(["+topology=pp2", f"tune.memory_budget_mb={budget}", "tune.steps=3"])
            shape = resolve_shape(cfg)
            for name in ("rayhybrid", "lightning-style"):
                host, sizes = TrialHost(cfg, shape), []

                def trial(m: int, host=host, sizes=sizes) -> dict:
                    sizes.append(m)
                    return host.run({"micro_batch_size": m, "num_microbatches": 2, "activation_checkpointing": False})

                start = time.perf_counter()
                if name == "rayhybrid":
                    # The probes where `python -m rayhybrid.tune` puts them: the planner's largest
                    # size under the budget less the margin, and half of it.
                    largest = space.largest_planned(
                        cfg, lambda m, cfg=cfg: base_point(cfg, False, m), budget * (1 - cfg.tune.margin)
                    )
                    search = MicroBatchSearch(budget, probes=space.planned_probes(largest, (1, 2)))
                    while (m := search.next()) is not None:
                        r = trial(m)
                        search.observe(m, peaks_from_result(r), bool(r["oom"]))
                    best = search.best
                else:
                    best = lightning_binsearch(
                        lambda m, budget=budget: (
                            not (r := trial(m))["oom"] and not r["error"] and r["peak_mb"] <= budget
                        ),
                        init=2,
                    )
                rows.append(
                    {
                        "budget_mb": budget,
                        "search": name,
                        "trials": len(sizes),
                        "sizes": sizes,
                        "largest": best,
                        "wall_s": time.perf_counter() - start,
                    }
                )
                host.shutdown()
    finally:
        ray.shutdown()
    return {"rows": rows}


def lightning_binsearch(fits, init: int = 2, max_trials: int = 25) -> int:
    """PyTorch Lightning's BatchSizeFinder(mode="binsearch"): double from `init` until a size
    fails, then halve the gap between the last success and the failure."""
    low, high, size = 0, None, init
    for _ in range(max_trials):
        if fits(size):
            low = size
            if high is None:
                size *= 2
                continue
        else:
            high = size
        if high - low <= 1:
            break
        size = (low + high) // 2
    return low


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
    out = (
        "## 5. Batch-size search\n\nThe largest micro-batch that fits a per-rank budget (pp2, tiny default "
        "model, 2 micro-batches, CPU tensor accounting), each trial a real 3-step run on workers kept across "
        "trials. rayhybrid's search (`rayhybrid/tune/memory_search.py`: probes where the planner puts the answer and half "
        "of it, fit memory per micro-batch, predict, verify, one step to the edge) "
        'against Lightning\'s `BatchSizeFinder(mode="binsearch")` rule (double from 2 until a size fails, then '
        "bisect) on the same trial runner.\n\n"
    )
    out += header(r)
    if "rows" in r:
        out += table(
            ["budget (MB)", "search", "trials", "sizes tried", "largest", "wall (s)"],
            [
                [
                    fmt(x["budget_mb"], 0),
                    x["search"],
                    str(x["trials"]),
                    " ".join(map(str, x["sizes"])),
                    str(x["largest"]),
                    fmt(x["wall_s"], 1),
                ]
                for x in r["rows"]
            ],
        )
    return out


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    return "  ".join(
        f"{x['budget_mb']:.0f}MB {x['search']}: {x['trials']} trials {x['wall_s']:.0f}s -> {x['largest']}"
        for x in r["rows"]
    )
