"""One GPU: rayhybrid against a plain PyTorch + transformers loop, Llama 3.2 1B, sequence 2048.

    python benchmarks/run.py --only gpu      # about 8.5 minutes on one H100 or H200

Where CUDA is absent it measures nothing and says so (run.py then leaves BENCHMARKS.md's GPU
section as it was). On a GPU, in this order, each a fresh process (or one per micro-batch for
rayhybrid), within BUDGET_S of measuring in all, then MEMORY_BUDGET_S for the memory part:

1. the loop (benchmarks/baselines/hf_loop.py: `LlamaForCausalLM` of the same config, sdpa,
   float32 weights under bfloat16 autocast, fused AdamW), eager, then with `torch.compile`;
2. `python -m rayhybrid model=llama3.2_1b data=synthetic data.seq_len=2048 train.dtype=bfloat16`
   with dp 1, then with `train.compile=true`, then (float8 GPUs: compute capability 8.9 and up)
   `train.compile=true train.float8=true`.

Each of the five sweeps the micro-batch sizes POINTS (global batch = micro-batch: one
micro-batch a step) as `hf_loop.sweep` says: upwards until one runs out of memory, or is
predicted to from the peaks of the last two, or the run's share of the budget (what is left,
split evenly among the runs still to come) would not cover another; if the first size does not
fit, halves of it. WARMUP + STEPS steps per point; tokens/s over the STEPS after warm-up. Each
run is compared at its best micro-batch. MFU: rayhybrid's own count for both (the model spec's
`flops_per_token`, the peak of `rayhybrid.driver.observe.PEAK_TFLOPS` for the card). Start-up:
summary.json's `startup_s` and `startup` phases when the run writes them, and the wall time from
the command to the first step's record as watched from here.

3. the largest micro-batch that fits without activation checkpointing, for each of
   MEMORY_SETTINGS (the chunked loss, the default; the whole batch's logits, `train.loss_chunk=0`;
   the chunked loss with `train.offload_activations=true`): one `python -m rayhybrid.tune` each
   (`tune.activation_checkpointing=[false]`, the card's memory as the budget), its memory trials,
   tokens/s at the largest size, and the plan (`python -m rayhybrid.plan --device cuda`:
   allocated and reserved) against the measured peaks (the allocator's max allocated and max
   reserved) there (`memory_sweep`).

Expected duration: about 8.5 minutes on one H100 or H200 (8 of them the measuring budgets, the
rest the card probe and the runs' first points past it); a first run also fills torch's compile caches.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import time
from pathlib import Path

import common
from baselines.hf_loop import sweep
from figures import fmt, header, table

HEADING = "## 9. One GPU: rayhybrid against a plain PyTorch + transformers loop"
SHAPE = ["model=llama3.2_1b", "data=synthetic", "data.seq_len=2048", "train.dtype=bfloat16"]
POINTS = (8, 12, 16)
WARMUP, STEPS = 3, 5
BUDGET_S = 240.0
MEMORY_BUDGET_S = 240.0
MEMORY_SETTINGS = (
    ("chunked loss", []),
    ("whole-batch loss", ["train.loss_chunk=0"]),
    ("chunked loss + offload", ["train.offload_activations=true"]),
)
"""The settings whose largest micro-batch is measured: the default (the loss in chunks), the loss
over the whole micro-batch's logits, and activations offloaded to host memory."""
MEMORY_GOAL = 24  # issue 40: micro-batch 24 or more without checkpointing on an H200 (16 before)
GOALS = {"speedup": 1.15, "mfu": 0.50, "startup_s": 12.0}
LOOPS = (("loop, eager", []), ("loop, compiled", ["--compile"]))
RAYHYBRID = (
    ("rayhybrid", []),
    ("rayhybrid, compile", ["train.compile=true"]),
    ("rayhybrid, compile + float8", ["train.compile=true", "train.float8=true"]),
)
PROBE = (
    "import json, torch\n"
    "ok = torch.cuda.is_available()\n"
    "p = torch.cuda.get_device_properties(0) if ok else None\n"
    "print(json.dumps(ok and {'name': p.name, 'capability': [p.major, p.minor], 'memory_mb': p.total_memory / 2**20,"
    " 'torch': torch.__version__, 'cuda': torch.version.cuda}))\n"
)


def probe() -> dict | None:
    """The card (name, capability, memory_mb, torch, cuda), read in a separate process so this
    one holds no CUDA context; None without CUDA."""
    out = subprocess.run(
        [common.PY, "-c", PROBE], env=common.env(), capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1]) or None


def run(tmp: Path, quick: bool) -> dict:
    """The comparison on this machine's GPU; {"skipped": why} without one. `quick`: the first
    micro-batch size only."""
    card = probe()
    if card is None:
        return {"skipped": "no CUDA device here (torch.cuda.is_available() is false)"}
    float8 = tuple(card["capability"]) >= (8, 9)
    runs = [*LOOPS, *(r for r in RAYHYBRID if float8 or "train.float8=true" not in r[1])]
    out = measure(tmp, card, SHAPE, POINTS[:1] if quick else POINTS, runs, BUDGET_S)
    out["memory"] = memory_sweep(tmp, card, SHAPE, MEMORY_SETTINGS, MEMORY_BUDGET_S)
    return out


def memory_sweep(tmp: Path, card: dict, shape: list[str], settings, budget_s: float, extra=()) -> dict:
    """For each of `settings` ((label, overrides)), one `python -m rayhybrid.tune` searching the
    largest micro-batch without activation checkpointing (`memory_setting`), within `budget_s`
    in all (each its share of what is left). `extra`: overrides for every run (a test's budget)."""
    out = {"settings": {}, "budget_s": budget_s}
    deadline = time.perf_counter() + budget_s
    for i, (label, overrides) in enumerate(settings):
        left = deadline - time.perf_counter()
        if left < 20:
            out["settings"][label] = {"extra": overrides, "error": "not run: the measuring budget was spent"}
            continue
        try:
            result = memory_setting(tmp, card, [*shape, *overrides, *extra], label, left / (len(settings) - i))
        except Exception as err:  # noqa: BLE001 - one failed setting must not lose the others
            result = {"error": f"{type(err).__name__}: {err}"[-1500:]}
        out["settings"][label] = {"extra": overrides, **result}
    return out


def memory_setting(tmp: Path, card: dict, overrides: list[str], label: str, budget_s: float) -> dict:
    """One tune run's answer: the largest micro-batch, the memory trials it took, and at that size
    tokens/s, the measured peaks (`peak_mb`: what limits the run, the reserved bytes on CUDA;
    `allocated_mb`) and the plan's (`planned_mb`, `planned_reserved_mb` on CUDA)."""
    import csv

    slug = "".join(c if c.isalnum() else "-" for c in label)
    args = [*overrides, "tune.activation_checkpointing=[false]", "tune.steps=3"]
    start = time.perf_counter()
    run = common.Run(args, tmp / f"tune-{slug}", module="rayhybrid.tune")
    try:
        run.proc.wait(timeout=max(60.0, budget_s + 30))
    except subprocess.TimeoutExpired:
        _stop(run.proc)
        return {
            "error": f"tune did not finish in {max(60.0, budget_s + 30):.0f} s",
            "wall_s": time.perf_counter() - start,
        }
    run._reader.join(timeout=5)
    summary_path = run.run_dir / "tune_summary.json"
    if run.proc.returncode != 0 or not summary_path.exists():
        return {"error": f"tune failed ({run.proc.returncode}): {''.join(run.output[-20:])}"[-1500:]}
    summary = json.loads(summary_path.read_text())
    with open(run.run_dir / "tune_results.csv") as f:
        rows = list(csv.DictReader(f))
    largest = summary["largest_micro_batch"].get("false")
    at = [r for r in rows if int(r["micro_batch_size"]) == largest and int(r["num_microbatches"]) == 1]
    at = [r for r in at if r["fits"] == "1"]
    row = at[0] if at else {}
    return {
        "largest": largest,
        "memory_trials": summary["memory_trials"].get("false"),
        "trials": [(int(r["micro_batch_size"]), r["oom"] == "1", r["purpose"]) for r in rows],
        "tokens_per_s": float(row["tokens_per_s"]) if row.get("tokens_per_s") else None,
        "peak_mb": float(row["peak_mb"]) if row.get("peak_mb") else None,
        "allocated_mb": float(row["allocated_peak_mb"]) if row.get("allocated_peak_mb") else None,
        **(planned(overrides, largest, card) if largest else {}),
        "wall_s": time.perf_counter() - start,
    }


def planned(overrides: list[str], mb: int, card: dict) -> dict:
    """The plan of micro-batch `mb` (one micro-batch a step) on the card's device: its allocated
    peak, and on CUDA its reserved one."""
    from rayhybrid.plan.dry_run import build_plan
    from rayhybrid.preflight import load_config

    cfg = load_config([*overrides, f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}"])
    memory = build_plan(cfg, device="cuda" if card.get("cuda") else "cpu")["memory"]
    return {"planned_mb": memory["max_mb"], "planned_reserved_mb": memory["max_reserved_mb"]}


def measure(tmp: Path, card: dict, shape: list[str], points, runs, budget_s: float, warmup=WARMUP, steps=STEPS) -> dict:
    """Every run of `runs` ((label, extra arguments): a label starting "loop" runs hf_loop.py,
    any other rayhybrid) swept over `points` on the model of `shape`; the results (JSON-able)."""
    from rayhybrid.driver.observe import device_peak_tflops
    from rayhybrid.models.registry import get_spec
    from rayhybrid.preflight import load_config

    cfg = load_config(shape)
    out = {
        "card": card,
        "shape": shape,
        "points": list(points),
        "warmup": warmup,
        "steps": steps,
        "flops_per_token": get_spec(cfg.model).flops_per_token(cfg.model, cfg.data.seq_len),
        "peak_tflops": device_peak_tflops(cfg, card["name"]),
        "runs": {},
    }
    deadline = time.perf_counter() + budget_s
    for i, (label, extra) in enumerate(runs):
        left = deadline - time.perf_counter()
        share = left / (len(runs) - i)
        if left < 20:
            out["runs"][label] = {"extra": extra, "error": "not run: the measuring budget was spent"}
            continue
        try:
            if label.startswith("loop"):
                result = _loop(shape, extra, points, warmup, steps, share)
            else:
                result = rayhybrid_sweep(tmp, label, shape + extra, points, warmup, steps, share, card)
        except Exception as err:  # noqa: BLE001 - one failed run must not lose the others
            result = {"error": f"{type(err).__name__}: {err}"[-1500:]}
        out["runs"][label] = {"extra": extra, **result}
    return out


def _loop(shape, extra, points, warmup, steps, budget_s) -> dict:
    args = [*shape, *extra, "--micro-batches", ",".join(map(str, points))]
    args += ["--warmup", str(warmup), "--steps", str(steps), "--budget-s", f"{budget_s:.0f}"]
    r = common.baseline("hf_loop.py", args, timeout=max(180.0, budget_s + 180))
    first = r["points"][0].get("first_step_wall")
    phases = {
        "process_and_imports": r["imports_done_wall"] - r["launched_wall"],
        "model_build": r["built_wall"] - r["imports_done_wall"],
        "first_step": first - r["built_wall"] if first else None,
    }
    return {
        "points": r["points"],
        "startup_s": first - r["launched_wall"] if first else None,
        "startup": phases,
        "startup_point": r["points"][0]["micro_batch"],
        "versions": {"torch": r["torch"], "transformers": r["transformers"]},
        "compile_backend": r["compile_backend"],
    }


def rayhybrid_sweep(tmp, label, overrides, points, warmup, steps, budget_s, card) -> dict:
    """`hf_loop.sweep` over rayhybrid runs (`rayhybrid_point`), predicting out-of-memory from the
    card's `memory_mb`."""
    slug = "".join(c if c.isalnum() else "-" for c in label)
    capacity = card.get("memory_mb")
    timeout = max(120.0, budget_s + 60)  # for a run that hangs: it must not take the others' time

    def point(mb: int) -> dict:
        return rayhybrid_point(tmp / f"{slug}-{mb}", overrides, mb, warmup, steps, timeout)

    return {"points": sweep(points, point, budget_s, capacity)}


def rayhybrid_point(run_dir: Path, overrides: list[str], mb: int, warmup: int, steps: int, timeout=600.0) -> dict:
    """One `python -m rayhybrid` run of micro-batch (and global batch) `mb`, `warmup + steps`
    steps, no checkpoints, no restarts, the allocator's peaks recorded; its figures, or `oom`,
    or `error`."""
    args = [*overrides, f"train.global_batch_size={mb}", f"train.micro_batch_size={mb}"]
    args += [f"train.steps={warmup + steps}", "checkpoint.every=0", "fault.max_restarts=0", "metrics.memory=true"]
    args += ["train.log_every=100"]
    start = time.perf_counter()
    run = common.Run(args, run_dir)
    try:
        run.wait_for_step(1, timeout)
        summary = run.finish(timeout)
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as err:
        _stop(run.proc)
        summary_path = run_dir / "summary.json"
        said = str(err) + (summary_path.read_text() if summary_path.exists() else "")
        wall = time.perf_counter() - start
        if "OutOfMemoryError" in said or "out of memory" in said.lower():
            return {"oom": True, "wall_s": wall}
        return {"error": f"{type(err).__name__}: {err}"[-1500:], "wall_s": wall}
    records = common.steps_of(run_dir)
    measured = records[warmup:] or records
    seq = summary.get("data", {}).get("seq_len") or _seq_len(overrides)
    peaks = [max(r["peak_mb"].values()) for r in records if r.get("peak_mb")]
    return {
        "oom": False,
        "step_times_s": [round(r["step_time_s"], 5) for r in records],
        "tokens_per_s": mb * seq * len(measured) / sum(r["step_time_s"] for r in measured),
        "peak_mb": max(peaks) if peaks else None,
        "data_wait_s": statistics.median(r.get("data_wait_s") or 0.0 for r in measured),
        "mfu_logged": summary.get("mfu"),
        "device_name": summary.get("device_name"),
        "startup_s": summary.get("startup_s"),
        "startup": summary.get("startup"),
        "first_step_watched_s": run.first_step_s,
        "wall_s": time.perf_counter() - start,
    }


def _stop(proc: subprocess.Popen) -> None:
    """End a run that hangs: Ctrl-C first (the driver then stops its Ray and workers, which
    hold the GPU's memory), killed if it is still there 30 s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _seq_len(overrides: list[str]) -> int:
    return int(next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("data.seq_len=")))


def best(run: dict) -> dict | None:
    """The point of a run with the most tokens/s, or None (none fitted, or the run failed)."""
    fitted = [p for p in run.get("points", []) if p.get("tokens_per_s")]
    return max(fitted, key=lambda p: p["tokens_per_s"]) if fitted else None


def mfu(r: dict, point: dict | None) -> float | None:
    """Model FLOPs utilisation of `point`, by rayhybrid's count, when the card's peak is known."""
    if point is None or not r.get("peak_tflops"):
        return None
    return r["flops_per_token"] * point["tokens_per_s"] / (r["peak_tflops"] * 1e12)


INTRO = (
    "rayhybrid on one GPU against a plain PyTorch + transformers loop (`benchmarks/baselines/hf_loop.py`: "
    "`LlamaForCausalLM` built from the same config, sdpa attention, float32 weights under bfloat16 autocast, "
    "fused AdamW, random tokens made on the GPU), eager and with `torch.compile`. Llama 3.2 1B "
    "(`model=llama3.2_1b`), sequence 2048, `train.dtype=bfloat16`, dp 1, one micro-batch a step; rayhybrid "
    "reads `data=synthetic`, also with `train.compile=true` and, on float8 GPUs, `train.compile=true "
    "train.float8=true`. Each run sweeps the micro-batch sizes 8, 12, 16 (stopping at out-of-memory; halves of "
    "8 if 8 does not fit) and is compared at its best; tokens/s over the steps after warm-up, MFU by rayhybrid's "
    "FLOP count for both (the model spec's `flops_per_token`). Goals: tokens/s at least 1.15x the compiled "
    "loop's, MFU at least 50%, start-up to the first step at most 12 s. `python benchmarks/run.py --only gpu` "
    "takes about 8.5 minutes on one H100 or H200 (a 4-minute measuring budget shared out among the runs, "
    "4 minutes for the largest micro-batch per memory setting).\n\n"
)


def unmeasured() -> str:
    """The section before any GPU run has written it."""
    return (
        f"{HEADING}\n\n{INTRO}Not yet measured on a GPU: run `python benchmarks/run.py --only gpu` on a machine "
        "with CUDA to write this section.\n\n"
    )


def _memory(mb) -> str:
    if mb is None:
        return "n/a"
    return f"{mb / 1024:.1f} GiB" if mb >= 1024 else f"{mb:.1f} MB"


def _label(label: str, run: dict) -> str:
    backend = run.get("compile_backend")
    return label + (f" (backend {backend})" if backend and backend != "inductor" else "")


def _startup(run: dict, point: dict | None) -> tuple[float | None, dict | None]:
    """Seconds to the first step and its phases: the loop's (its first point), rayhybrid's
    summary.json figures at `point`, else the time watched from the command to the first step."""
    if "startup_s" in run:
        return run["startup_s"], run.get("startup")
    if point is None:
        return None, None
    return point.get("startup_s") or point.get("first_step_watched_s"), point.get("startup")


def _why_none(run: dict) -> str:
    if "error" in run:
        return "failed: " + run["error"].splitlines()[0][:200]
    points = run.get("points", [])
    errors = [p["error"] for p in points if p.get("error")]
    if errors:
        return "failed: " + errors[0].splitlines()[0][:200]
    return "out of memory at every size tried" if points else "not run"


def goals(r: dict) -> dict:
    """The goals' figures: rayhybrid's best tokens/s over the compiled loop's, its best MFU,
    and the start-up of plain `rayhybrid` (None where a figure is missing)."""
    loop = best(r["runs"].get("loop, compiled", {}))
    ours = [(label, best(run)) for label, run in r["runs"].items() if not label.startswith("loop")]
    ours = [(label, p) for label, p in ours if p is not None]
    top = max(ours, key=lambda x: x[1]["tokens_per_s"], default=(None, None))
    plain = r["runs"].get("rayhybrid", {})
    return {
        "speedup": top[1]["tokens_per_s"] / loop["tokens_per_s"] if top[1] and loop else None,
        "speedup_run": top[0],
        "mfu": max((mfu(r, p) for _, p in ours if mfu(r, p) is not None), default=None),
        "startup_s": _startup(plain, best(plain))[0],
    }


def _goal_line(r: dict) -> str:
    g = goals(r)
    parts = []
    for key, text, shown, higher in (
        ("speedup", "tokens/s at least 1.15x the compiled loop's", lambda v: f"{v:.2f}x ({g['speedup_run']})", True),
        ("mfu", "MFU at least 50%", lambda v: f"{v:.1%}", True),
        ("startup_s", "start-up at most 12 s", lambda v: f"{v:.1f} s (`rayhybrid`)", False),
    ):
        v = g[key]
        if v is None:
            parts.append(f"{text}: not measured")
        else:
            met = v >= GOALS[key] if higher else v <= GOALS[key]
            parts.append(f"{text}: **{shown(v)}**, {'met' if met else 'not met'}")
    return "Goals: " + "; ".join(parts) + ".\n\n"


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
    out = f"{HEADING}\n\n{INTRO}" + header(r)
    if "runs" not in r:
        return out
    c = r["card"]
    versions = next((run["versions"] for run in r["runs"].values() if "versions" in run), {})
    out += (
        f"Card: **{c['name']}** ({c['memory_mb'] / 1024:.0f} GiB, compute capability "
        f"{'.'.join(map(str, c['capability']))}), torch {c['torch']}, CUDA {c['cuda']}"
        + (f", transformers {versions['transformers']}" if versions else "")
        + f". {r['flops_per_token'] / 1e9:.3g} GFLOP per token; peak for MFU "
        + (f"{r['peak_tflops']:g} TFLOP/s" if r.get("peak_tflops") else "unknown for this card")
        + f". {r['warmup']} warm-up and {r['steps']} measured steps per point.\n\n"
    )
    compiled = best(r["runs"].get("loop, compiled", {}))
    rows = []
    for label, run in r["runs"].items():
        p = best(run)
        if p is None:
            rows.append([_label(label, run), _why_none(run), "", "", "", "", ""])
            continue
        ratio = f"{p['tokens_per_s'] / compiled['tokens_per_s']:.2f}x" if compiled else "n/a"
        startup = _startup(run, p)[0]
        cells = [str(p["micro_batch"]), f"{p['tokens_per_s']:,.0f}", ratio, fmt(mfu(r, p), pct=True)]
        rows.append([_label(label, run), *cells, _memory(p.get("peak_mb")), fmt(startup, 1)])
    heads = ["run", "best micro-batch", "tokens/s", "/ compiled loop", "MFU", "peak memory", "start-up (s)"]
    out += table(heads, rows) + _goal_line(r) + _sweep_table(r) + _startup_lines(r)
    return out + _memory_section(r.get("memory"))


def _vs(planned_mb, measured_mb) -> str:
    """ "planned / measured (+x.x%)" in MB."""
    if planned_mb is None or measured_mb is None:
        return "n/a"
    return f"{planned_mb:,.0f} / {measured_mb:,.0f} ({planned_mb / measured_mb - 1:+.1%})"


def _memory_section(m: dict | None) -> str:
    """The largest micro-batch per setting (`memory_sweep`'s results), against the goal."""
    if not m or not m.get("settings"):
        return ""
    rows = []
    for label, s in m["settings"].items():
        name = label + (f" (`{' '.join(s['extra'])}`)" if s.get("extra") else "")
        if s.get("largest") is None:
            rows.append([name, "", "", "", "", "", _why_not(s)])
            continue
        trials = ", ".join(f"{mb}{' OOM' if oom else ''}" for mb, oom, purpose in s["trials"] if purpose == "memory")
        rows.append(
            [
                name,
                str(s["largest"]),
                f"{s['memory_trials']} ({trials})",
                f"{s['tokens_per_s']:,.0f}" if s.get("tokens_per_s") else "n/a",
                _vs(s.get("planned_mb"), s.get("allocated_mb") or s.get("peak_mb")),
                _vs(s.get("planned_reserved_mb"), s.get("peak_mb")) if s.get("planned_reserved_mb") else "n/a",
                "",
            ]
        )
    heads = [
        "setting",
        "largest micro-batch",
        "memory trials (sizes)",
        "tokens/s at it",
        "planned / measured allocated (MB)",
        "planned / measured reserved (MB)",
        "note",
    ]
    chunked = m["settings"].get(MEMORY_SETTINGS[0][0], {}).get("largest")
    goal = (
        f"Goal: micro-batch {MEMORY_GOAL} or more without activation checkpointing with the chunked loss: "
        + (f"**{chunked}**, {'met' if chunked >= MEMORY_GOAL else 'not met'}" if chunked else "not measured")
        + " (16 before the chunked loss). At most 4 memory trials per setting.\n\n"
    )
    return (
        "Largest micro-batch without activation checkpointing (`python -m rayhybrid.tune "
        "tune.activation_checkpointing=[false]`, the card's memory as the budget, one micro-batch a step): "
        "the trials the memory search took, tokens/s at the largest size, and the plan "
        "(`python -m rayhybrid.plan --device cuda`) against the allocator's peaks there (max allocated; "
        "max reserved, what must fit the card).\n\n" + table(heads, rows) + goal
    )


def _why_not(s: dict) -> str:
    if "error" in s:
        return "failed: " + s["error"].strip().splitlines()[-1][:200] if s["error"].strip() else "failed"
    return "nothing fitted"


def _sweep_table(r: dict) -> str:
    rows = []
    for label, run in r["runs"].items():
        for p in run.get("points", []):
            if p.get("tokens_per_s"):
                wait = p.get("data_wait_s")
                figures = [f"{p['tokens_per_s']:,.0f}", _memory(p.get("peak_mb")), fmt(wait and wait * 1e3, 1), ""]
            else:
                why = p.get("skipped") or ("out of memory" if p.get("oom") else (p.get("error") or "").splitlines()[0])
                figures = ["", "", "", why[:200]]
            rows.append([_label(label, run), str(p["micro_batch"]), *figures])
    heads = ["run", "micro-batch", "tokens/s", "peak memory", "data wait (ms, median)", "note"]
    return "Every point of the sweeps (the loop makes its batch on the device: no data wait):\n\n" + table(heads, rows)


def _startup_lines(r: dict) -> str:
    lines = []
    for label, run in r["runs"].items():
        point = best(run)
        seconds, phases = _startup(run, point)
        if seconds is None:
            continue
        where = f"micro-batch {run.get('startup_point') or point['micro_batch']}"
        said = ", ".join(f"{k.replace('_', ' ')} {fmt(v, 1)}" for k, v in (phases or {}).items() if v is not None)
        watched = (point or {}).get("first_step_watched_s") if "startup_point" not in run else None
        line = f"- {label} ({where}): {fmt(seconds, 1)} s" + (f": {said}" if said else "")
        lines.append(line + (f" ({watched:.1f} s from the command to its first step's record)" if watched else ""))
    if not lines:
        return ""
    return (
        "Start-up to the first step, by phase (rayhybrid: summary.json's `startup_s` and `startup` phases where "
        "the run writes them; the loop: from its command):\n\n" + "\n".join(lines) + "\n\n"
    )


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    if "runs" not in r:
        return "no figures"
    g = goals(r)
    return (
        f"{r['card']['name']}: rayhybrid / compiled loop {fmt(g['speedup'])}x, MFU {fmt(g['mfu'], pct=True)}, "
        f"start-up {fmt(g['startup_s'], 1)}s"
    )
