"""BENCHMARKS.md and the printed table, from benchmarks/results.json."""

from __future__ import annotations


def _f(x, digits=2, pct=False):
    if x is None:
        return "n/a"
    return f"{x:.1%}" if pct else f"{x:.{digits}f}"


def _header(r: dict) -> str:
    if "error" in r:
        return f"**Failed**: `{r['error']}`\n\n"
    return f"Command: `{r['command']}` ({r['date']}, {r['machine']}, {r['seconds']} s)\n\n"


def _table(heads: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n\n"


def markdown(results: dict) -> str:
    out = ["# Benchmarks\n\nWritten by `python benchmarks/run.py` (see its docstring); every ratio is between runs of "
           "one invocation on the machine named. Not part of the test suite.\n"]
    if r := results.get("scaling"):
        out.append("## 1. Scaling on this machine\n\nThroughput relative to one rank, torch threads = 1 per rank, model "
                   "4 layers x d 256, seq 128, vocab 2048; global batch 16 in micro-batches of 2. " + r.get("note", "") + ".\n\n")
        out.append(_header(r))
        if "rows" in r:
            out.append(_table(["case", "step (s)", "speed-up"],
                              [[x["case"], _f(x["step_s"], 3), _f(x["speedup"]) + "x"] for x in r["rows"]]))
    if r := results.get("overhead"):
        out.append("## 2. Orchestration overhead: torchrun vs rayhybrid\n\nSame model, parallelism and trainer code; "
                   "torchrun starts plain processes, rayhybrid Ray actors. Median steady-state step time.\n\n")
        out.append(_header(r))
        if "rows" in r:
            out.append(_table(["topology", "torchrun (s)", "rayhybrid (s)", "ratio", "same losses"],
                              [[x["case"], _f(x["torchrun_step_s"], 3), _f(x["rayhybrid_step_s"], 3), _f(x["ratio"], 3),
                                str(x["same_losses"])] for x in r["rows"]]))
    if r := results.get("startup"):
        out.append("## 3. Start-up: command to first completed step\n\nrayhybrid's command line against Ray Train's "
                   "`TorchTrainer` with as many workers (a fresh local Ray each).\n\n")
        out.append(_header(r))
        if "rows" in r:
            out.append(_table(["ranks", "rayhybrid (s)", "Ray Train (s)"],
                              [[str(x["ranks"]), _f(x["rayhybrid_s"], 1), _f(x["raytrain_s"], 1)] for x in r["rows"]]))
    if r := results.get("recovery"):
        out.append("## 4. Recovery: kill -9 of a rank to the first step after\n\n")
        out.append(_header(r))
        if "rayhybrid" in r:
            ours, theirs = r["rayhybrid"], r.get("raytrain", {})
            rows = [["rayhybrid (dp2_pp2_tp2, rank 5)", _f(ours.get("total_s"), 1),
                     ", ".join(f"{k[:-2]} {_f(v, 2)}" for k, v in ours.items() if k != "total_s" and v is not None)],
                    ["Ray Train (8 DDP workers)", _f(theirs.get("kill_to_first_step_s"), 1),
                     ", ".join(f"{k} {_f(v, 2) if isinstance(v, float) else v}" for k, v in (theirs.get("breakdown") or {}).items())]]
            out.append(_table(["", "total (s)", "breakdown (s)"], rows))
    if r := results.get("batch_search"):
        out.append(f"## 5. Batch-size search\n\nThe largest micro-batch that fits {r.get('budget_mb')} MB per rank "
                   "(pp2, tiny model, CPU tensor accounting), each trial a real 3-step run on kept workers.\n\n")
        out.append(_header(r))
        if "rows" in r:
            out.append(_table(["search", "trials", "sizes tried", "largest", "wall (s)"],
                              [[x["search"], str(x["trials"]), " ".join(map(str, x["sizes"])), str(x["largest"]),
                                _f(x["wall_s"], 1)] for x in r["rows"]]))
    if r := results.get("schedules"):
        out.append(f"## 6. Pipeline schedules\n\npp2, {r.get('micro_batches')} micro-batches of 2; bubble = the measured "
                   "idle share of the schedule's time (mean over ranks and steady steps); theory (pp-1)/(v m + pp-1) with "
                   "v stages per rank (zero-bubble schedules aim lower). Activation MB: bytes saved for backward at the "
                   "stage's peak (CPU tensor accounting).\n\n")
        out.append(_header(r))
        if "rows" in r:
            out.append(_table(["schedule", "bubble", "theory", "activation MB per stage", "peak MB per stage", "step (s)"],
                              [[x["schedule"], _f(x["bubble"], pct=True), _f(x["theory_bubble"], pct=True),
                                " / ".join(_f(v, 2) for v in (x["activation_mb"] or {}).values()),
                                " / ".join(_f(v, 2) for v in (x["peak_mb"] or {}).values()), _f(x["step_s"], 3)]
                               for x in r["rows"]]))
    return "".join(out)


def table(results: dict) -> str:
    lines = []
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:14s} FAILED {r['error'][:100]}")
        elif name == "scaling":
            lines.append(f"{name:14s} " + "  ".join(f"{x['case']}: {x['speedup']:.2f}x" for x in r["rows"]))
        elif name == "overhead":
            lines.append(f"{name:14s} " + "  ".join(f"{x['case']}: rayhybrid/torchrun {x['ratio']:.3f}" for x in r["rows"]))
        elif name == "startup":
            lines.append(f"{name:14s} " + "  ".join(f"{x['ranks']} ranks: {x['rayhybrid_s']:.1f}s vs Ray Train "
                                                   f"{x['raytrain_s']:.1f}s" for x in r["rows"]))
        elif name == "recovery":
            lines.append(f"{name:14s} rayhybrid {_f(r['rayhybrid'].get('total_s'), 1)}s vs Ray Train "
                         f"{_f(r['raytrain'].get('kill_to_first_step_s'), 1)}s")
        elif name == "batch_search":
            lines.append(f"{name:14s} " + "  ".join(f"{x['search']}: {x['trials']} trials {x['wall_s']:.0f}s -> {x['largest']}"
                                                   for x in r["rows"]))
        elif name == "schedules":
            lines.append(f"{name:14s} " + "  ".join(f"{x['schedule']}: {_f(x['bubble'], pct=True)} "
                                                   f"(theory {_f(x['theory_bubble'], pct=True)})" for x in r["rows"]))
    return "\n".join(lines)
