"""BENCHMARKS.md and the printed table, from benchmarks/results.json."""

from __future__ import annotations

INTRO = (
    "# Benchmarks\n\n"
    "Written by `python benchmarks/run.py` (see its docstring), which runs every case in fresh processes, one "
    "after another. Every ratio below is between runs of one invocation on the machine named; absolute times "
    "on a small shared machine say little. Not part of the test suite.\n\n"
    "The model, unless a section says otherwise: GPT, 4 layers, d 256, 4 heads, vocabulary 2048, sequence 128, "
    "float32, one torch thread per rank, gloo.\n"
)


def _f(x, digits=2, pct=False):
    if x is None:
        return "n/a"
    return f"{x:.1%}" if pct else f"{x:.{digits}f}"


def _header(r: dict) -> str:
    failed = f"**Failed**: `{r['error']}`\n\n" if "error" in r else ""
    return failed + f"Command: `{r['command']}` ({r['date']}, {r['machine']}, {r['seconds']} s)\n\n"


def _table(heads: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n\n"


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def _scaling(r: dict) -> str:
    out = (
        "## 1. Scaling on this machine\n\nThroughput relative to one rank: global batch 16 in micro-batches of "
        "2, median step time after two warm-up steps. The physical limit on 2 cores is 2.0x.\n\n"
    )
    out += _header(r)
    if "rows" not in r:
        return out
    out += _table(
        ["case", "step (s)", "speed-up"], [[x["case"], _f(x["step_s"], 3), _f(x["speedup"]) + "x"] for x in r["rows"]]
    )
    out += (
        f"What bounds these here: the same one-rank job run twice at once, with no communication at all, "
        f"takes {_f(r['pair_step_s'], 3)} s a step against {_f(r['alone_step_s'], 3)} s alone, so two ranks can "
        f"reach at most **{_f(r['ceiling'])}x** on this machine (shared caches and memory bandwidth). "
        f"The {r['backend']} all-reduce between two processes costs:\n\n"
    )
    out += _table(
        ["size", "time (ms)", "MB/s"],
        [[_size(x["bytes"]), _f(x["ms"]), f"{x['mb_per_s']:.0f}"] for x in r["allreduce"]],
    )
    out += (
        "dp2 all-reduces the gradients once a step; pp2 sends a micro-batch's activations (128 KB here) a "
        "few dozen times a step; tp2 all-reduces 256 KB activations twice per block in forward and again in "
        "backward, about 150 times a step, each in the critical path, plus DTensor's per-operator cost on "
        "matrices of 256 columns. On GPUs with NVLink the same all-reduce takes microseconds; on this "
        "machine tensor parallelism cannot pay off, and rayhybrid keeps it inside a node for that reason.\n\n"
    )
    return out


def _overhead(r: dict) -> str:
    out = (
        "## 2. Orchestration overhead: torchrun vs rayhybrid\n\nThe same model, parallelism and trainer code "
        "(`benchmarks/baselines/torchrun_train.py` runs rayhybrid's `Trainer` in processes torchrun starts); "
        "rayhybrid drives Ray actors one step at a time from its driver. Median over "
        f"{r.get('runs_each', '?')} runs of each launcher, alternating (A B B A), after two warm-up steps. "
        "*In-step*: the step as timed inside the ranks. *Step to step*: wall time between consecutive steps, "
        "which adds the launcher's own per-step cost (for rayhybrid, the call from the driver and the "
        "metrics record).\n\n"
    )
    out += _header(r)
    if "rows" in r:
        out += _table(
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
                    _f(x["torchrun_step_s"], 3),
                    _f(x["rayhybrid_step_s"], 3),
                    _f(x["step_ratio"], 3),
                    _f(x["torchrun_wall_s"], 3),
                    _f(x["rayhybrid_wall_s"], 3),
                    _f(x["wall_ratio"], 3),
                    "yes" if x["same_losses"] else "no",
                ]
                for x in r["rows"]
            ],
        )
        out += (
            "Each run's median in-step time (s), to show how far the machine itself moved between runs: "
            + "; ".join(
                f"{x['case']}: rayhybrid {' '.join(_f(v, 3) for v in x.get('rayhybrid_runs_s', []))}, torchrun "
                f"{' '.join(_f(v, 3) for v in x.get('torchrun_runs_s', []))}"
                for x in r["rows"]
            )
            + ".\n\n"
        )
    return out


def _startup(r: dict) -> str:
    out = (
        "## 3. Start-up: command to first completed step\n\nrayhybrid's command line against Ray Train's "
        "`TorchTrainer` (`benchmarks/baselines/raytrain_train.py`: DDP, the same model, data and optimizer) "
        "with as many workers; each starts a fresh local Ray. Tiny default model, 2 steps.\n\n"
    )
    out += _header(r)
    if "rows" in r:
        out += _table(
            ["ranks", "rayhybrid (s)", "Ray Train (s)", "Ray Train / rayhybrid", "Ray Train's start-up (s)"],
            [
                [
                    str(x["ranks"]),
                    _f(x["rayhybrid_s"], 1),
                    _f(x["raytrain_s"], 1),
                    _f(x["raytrain_s"] / x["rayhybrid_s"]) + "x",
                    ", ".join(
                        f"{k[:-2].replace('_', ' ')} {_f(v, 1)}"
                        for k, v in (x.get("raytrain_startup") or {}).items()
                        if v is not None
                    ),
                ]
                for x in r["rows"]
            ],
        )
        out += (
            "In Ray Train's columns *start group* (the controller starting the worker group) includes *last proc "
            "started* (its processes spawned) and the torch process group's set-up; *build model* is the workers "
            "importing torch and building the model, all at once on the same cores.\n\n"
        )
    return out


def _recovery(r: dict) -> str:
    out = (
        "## 4. Recovery: kill -9 of a rank to the first step after it\n\nrayhybrid: dp2_pp2_tp2 (8 ranks), "
        "a checkpoint every 3 steps, rank 5 killed after step 5; only the dead rank's process is replaced. "
        "Ray Train: 8 DDP workers, `FailureConfig(max_failures=1)`, a checkpoint reported every step, worker 5 "
        "killed after step 5's checkpoint is committed; Ray Train restarts the whole worker group.\n\n"
    )
    out += _header(r)
    if "rayhybrid" in r:
        ours, theirs = r["rayhybrid"], r.get("raytrain", {})
        rows = [
            [
                "rayhybrid",
                _f(ours.get("total_s"), 1),
                ", ".join(
                    f"{k[:-2].replace('_', ' ')} {_f(v)}" for k, v in ours.items() if k != "total_s" and v is not None
                ),
            ],
            [
                "Ray Train",
                _f(theirs.get("kill_to_first_step_s"), 1),
                ", ".join(
                    f"{k[:-2].replace('_', ' ')} {_f(v)}"
                    for k, v in (theirs.get("breakdown") or {}).items()
                    if v is not None
                ),
            ],
        ]
        out += _table(["", "kill to next step (s)", "breakdown (s)"], rows)
        if theirs.get("kill_to_first_step_s") and ours.get("total_s"):
            out += (
                f"Ray Train takes {theirs['kill_to_first_step_s'] / ours['total_s']:.1f}x as long; it redid "
                f"{theirs.get('steps_redone', '?')} step(s) (rayhybrid redoes the steps since its last checkpoint).\n\n"
            )
    return out


def _batch_search(r: dict) -> str:
    out = (
        "## 5. Batch-size search\n\nThe largest micro-batch that fits a per-rank budget (pp2, tiny default "
        "model, 2 micro-batches, CPU tensor accounting), each trial a real 3-step run on workers kept across "
        "trials. rayhybrid's search (`rayhybrid/tune/search.py`: fit memory per micro-batch, predict, verify) "
        'against Lightning\'s `BatchSizeFinder(mode="binsearch")` rule (double from 2 until a size fails, then '
        "bisect) on the same trial runner.\n\n"
    )
    out += _header(r)
    if "rows" in r:
        out += _table(
            ["budget (MB)", "search", "trials", "sizes tried", "largest", "wall (s)"],
            [
                [
                    _f(x["budget_mb"], 0),
                    x["search"],
                    str(x["trials"]),
                    " ".join(map(str, x["sizes"])),
                    str(x["largest"]),
                    _f(x["wall_s"], 1),
                ]
                for x in r["rows"]
            ],
        )
    return out


def _schedules(r: dict) -> str:
    out = (
        f"## 6. Pipeline schedules\n\npp2, {r.get('micro_batches')} micro-batches of 2 (interleaved and ZB-V: 2 "
        "stages per rank). *Bubble*: the idle share of the schedule's time, measured from each rank's chunk "
        "timings (median of steady steps, mean over ranks), next to the formula for equal stage times. "
        "*Activations*: the most bytes saved for backward on each pipeline rank during the step (CPU tensor "
        "accounting; on the last stage this includes every micro-batch's logits, which torch's schedules keep), "
        "next to theory: the most micro-batches in flight per stage in the schedule's order x what one "
        "micro-batch saves. *Peak*: each rank's whole peak next to what `python -m rayhybrid.plan` predicts.\n\n"
    )
    out += _header(r)
    if "rows" in r:

        def mbs(xs):
            return " / ".join(_f(v, 1) for v in xs)

        out += _table(
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
                    _f(x["bubble"], pct=True),
                    _f(x["theory_bubble"], pct=True),
                    mbs(x["activation_mb"]),
                    mbs(x["plan_activation_mb"]),
                    " / ".join(", ".join(f"{k}: {v}" for k, v in d.items()) for d in x["in_flight"]),
                    mbs(x["peak_mb"]),
                    mbs(x["plan_peak_mb"]),
                    _f(x["step_s"], 3),
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


SECTIONS = {
    "scaling": _scaling,
    "overhead": _overhead,
    "startup": _startup,
    "recovery": _recovery,
    "batch_search": _batch_search,
    "schedules": _schedules,
}


def markdown(results: dict) -> str:
    return INTRO + "\n" + "".join(SECTIONS[name](results[name]) for name in SECTIONS if name in results)


def table(results: dict) -> str:
    """One line per benchmark: the figures that matter."""
    lines = []
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:13s} FAILED {r['error'][:100]}")
        elif name == "scaling":
            lines.append(
                f"{name:13s} "
                + "  ".join(f"{x['case']}: {x['speedup']:.2f}x" for x in r["rows"])
                + f"  (ceiling here {r['ceiling']:.2f}x)"
            )
        elif name == "overhead":
            lines.append(
                f"{name:13s} rayhybrid/torchrun "
                + "  ".join(
                    f"{x['case']}: in-step {x['step_ratio']:.3f}, step to step {x['wall_ratio']:.3f}" for x in r["rows"]
                )
            )
        elif name == "startup":
            lines.append(
                f"{name:13s} "
                + "  ".join(
                    f"{x['ranks']} ranks: rayhybrid {x['rayhybrid_s']:.1f}s, Ray Train {x['raytrain_s']:.1f}s"
                    for x in r["rows"]
                )
            )
        elif name == "recovery":
            lines.append(
                f"{name:13s} rayhybrid {_f(r['rayhybrid'].get('total_s'), 1)}s, Ray Train "
                f"{_f(r['raytrain'].get('kill_to_first_step_s'), 1)}s"
            )
        elif name == "batch_search":
            lines.append(
                f"{name:13s} "
                + "  ".join(
                    f"{x['budget_mb']:.0f}MB {x['search']}: {x['trials']} trials {x['wall_s']:.0f}s -> {x['largest']}"
                    for x in r["rows"]
                )
            )
        elif name == "schedules":
            lines.append(
                f"{name:13s} bubble "
                + "  ".join(
                    f"{x['schedule']} {_f(x['bubble'], pct=True)} (theory {_f(x['theory_bubble'], pct=True)})"
                    for x in r["rows"]
                )
            )
    return "\n".join(lines)
