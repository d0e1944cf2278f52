"""BENCHMARKS.md and the printed table, from benchmarks/results.json."""

from __future__ import annotations

from pathlib import Path

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
        "## 4. Recovery: a rank or node lost, to the first step after it\n\nrayhybrid: dp2_pp2_tp2 (8 ranks), "
        "a checkpoint every 3 steps; rank 5 SIGKILLed after step 5 (healed from its data-parallel peer, the "
        "default, and with `fault.heal=false` restored from the checkpoint of step 3), rank 3 SIGKILLed while "
        "step 6's checkpoint uploads, rank 5 stopped with SIGSTOP (`fault.step_timeout_s=5`); and dp2 on a "
        "2-node `Cluster` (health checks every 1 s, 3 failures) whose node of rank 0 dies outright after "
        "step 4 while a spare node comes up. Ray Train: 8 DDP workers, `FailureConfig(max_failures=1)`, a "
        "checkpoint reported every step, worker 5 killed after step 5's checkpoint is committed; Ray Train "
        "restarts the whole worker group. Kill to next step: from the signal to the driver's record of the "
        "next step.\n\n"
    )
    out += _header(r)
    cases, theirs = r.get("cases") or {}, r.get("raytrain") or {}
    rows = []
    for name, c in cases.items():
        phases = ", ".join(
            f"{k[:-2].replace('_', ' ')} {_f(c.get(k))}"
            for k in ("detect_s", "teardown_s", "place_s", "init_s", "restore_s", "first_step_s")
            if c.get(k) is not None
        )
        moved = f", {c['bytes_sent'] / 1e6:.2f} MB sent" if c.get("bytes_sent") else ""
        source = f"{c.get('healed')}, {c.get('steps_redone')}{moved}"
        rows.append([f"rayhybrid, {name}", _f(c.get("kill_to_next_step_s"), 1), source, phases])
    if theirs:
        rows.append(
            [
                "Ray Train",
                _f(theirs.get("kill_to_first_step_s"), 1),
                f"checkpoint, {theirs.get('steps_redone', '?')}",
                ", ".join(
                    f"{k[:-2].replace('_', ' ')} {_f(v)}"
                    for k, v in (theirs.get("breakdown") or {}).items()
                    if v is not None
                ),
            ]
        )
    if rows:
        out += _table(["", "kill to next step (s)", "state from, steps redone", "phases (s)"], rows)
    heal, ray_train = cases.get("peer heal", {}), theirs.get("kill_to_first_step_s")
    if heal.get("kill_to_next_step_s") and ray_train:
        out += f"Ray Train takes {ray_train / heal['kill_to_next_step_s']:.1f}x as long as a peer heal.\n\n"
    return out


def _batch_search(r: dict) -> str:
    out = (
        "## 5. Batch-size search\n\nThe largest micro-batch that fits a per-rank budget (pp2, tiny default "
        "model, 2 micro-batches, CPU tensor accounting), each trial a real 3-step run on workers kept across "
        "trials. rayhybrid's search (`rayhybrid/tune/memory_search.py`: probes where the planner puts the answer and half "
        "of it, fit memory per micro-batch, predict, verify, one step to the edge) "
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


def _checkpoints(r: dict) -> str:
    models = r.get("models", {})
    setup = "; ".join(
        f"{name}: {' '.join(m['overrides']) or 'the defaults'}, {m['steps']} steps, a save every {m['every']}"
        for name, m in models.items()
    )
    out = (
        "## 7. Checkpoints: asynchronous against synchronous saves\n\n"
        "One rank, the tiny default model (4 layers, d 64, vocabulary 256, sequence 64) and one about 100x "
        f"larger ({setup}; a save at the last step too), each run into a local directory and into S3, with "
        "`checkpoint.async_save` true and false. S3 is moto's server on 127.0.0.1, in the benchmark's own "
        "process: it runs on the same 2 cores as training, which a real S3 would not. *Blocked*: training "
        "stopped per save, as the rank measures it (async: the ranks' exchange of DCP's plans and a CPU copy of the state, plus waiting for the previous "
        "upload if it was still running; sync: the whole save). *Upload*: from staged to committed (sync: the "
        "write). *Driver pause*: the extra wall time the driver saw between the step before a save and the "
        "step after. *Uploading*: the steps from the one after a save to the one whose record the commit "
        "follows (the upload ran during all or part of each); *no upload*: the other steps after the first "
        "two. Medians over the saves and steps of one run per case; runs alternate async and sync.\n\n"
    )
    out += _header(r)
    if "rows" not in r:
        return out

    def steps(n, x):
        return f"{n}: {_f(x, 3)}" if n else "-"

    out += _table(
        [
            "model",
            "store",
            "save",
            "saves",
            "blocked (s)",
            "upload (s)",
            "blocked async / sync",
            "driver pause (s)",
            "step after a save (s)",
            "uploading: steps, median (s)",
            "no upload: steps, median (s)",
            "uploading / no upload",
            "train (s)",
        ],
        [
            [
                f"{x['model']} ({x['params'] / 1e6:.2f}M)",
                x["store"],
                "async" if x["async"] else "sync",
                str(x["saves"]) + (f", {len(x['failed'])} failed" if x["failed"] else ""),
                _f(x["blocked_s"], 3),
                _f(x["upload_s"], 3),
                _f(x.get("blocked_vs_sync"), 3) if x["async"] else "",
                _f(x["driver_pause_s"], 3),
                _f(x["after_save_s"], 3),
                steps(x["uploading_steps"], x["uploading_s"]),
                steps(x["quiet_steps"], x["quiet_s"]),
                _f(x["slowdown"]) + "x" if x["slowdown"] else "-",
                _f(x["train_s"], 1),
            ]
            for x in r["rows"]
        ],
    )
    notes = [
        f"{x['model']} {x['store']} {'async' if x['async'] else 'sync'}: {e}" for x in r["rows"] for e in x["failed"]
    ]
    if notes:
        out += "Failed saves: " + "; ".join(notes) + ".\n\n"
    long = [x for x in r["rows"] if x.get("outlasted")]
    if long:
        out += (
            "Uploads still running at the next save (which waited for them, inside its time blocked): "
            + "; ".join(f"{x['model']} {x['store']}: {x['outlasted']} of {x['saves']}" for x in long)
            + ".\n\n"
        )
    out += (
        "Noise: the quartiles of the no-upload steps (s), and the 1-minute load average before and after each "
        "run: "
        + "; ".join(
            f"{x['model']} {x['store']} {'async' if x['async'] else 'sync'} "
            f"{'/'.join(_f(q, 3) for q in x['quiet_quartiles_s'] or [])}, load {x['load'][0]:.1f} -> {x['load'][1]:.1f}"
            for x in r["rows"]
        )
        + ".\n\n"
    )
    out += _checkpoints_reading(r["rows"])
    return out


def _checkpoints_reading(rows: list[dict]) -> str:
    """What the numbers say, computed from them."""
    pairs = []
    for a in (x for x in rows if x["async"]):
        sync = [x for x in rows if (x["model"], x["store"]) == (a["model"], a["store"]) and not x["async"]]
        if sync:
            pairs.append((f"{a['model']} {a['store']}", a, sync[0]))

    def span(xs, fmt="{:.2f}"):
        xs = [x for x in xs if x is not None]
        return "n/a" if not xs else fmt.format(min(xs)) + (f"-{fmt.format(max(xs))}" if max(xs) != min(xs) else "")

    sync_after = [s["after_save_s"] / s["quiet_s"] for _, _, s in pairs if s["after_save_s"] and s["quiet_s"]]
    out = (
        f"Reading: an async save blocked training for {span([a.get('blocked_vs_sync') for _, a, _ in pairs])} of "
        "the time a sync save did (a copy of the state in memory instead of the whole write). The upload then "
        "shares the 2 cores with training: steps with an upload in flight took "
        f"{span([a['slowdown'] for _, a, _ in pairs])}x as long as steps without (the step right after a sync "
        f"save took {span(sync_after)}x, so this is the upload's doing), and the upload took "
        f"{span([a['upload_s'] / s['upload_s'] for _, a, s in pairs if a['upload_s'] and s['upload_s']])}x as "
        "long as the same write done synchronously. Training time, async over sync (below 1: async finished "
        "sooner): "
        + ", ".join(f"{name} {a['train_s'] / s['train_s']:.2f}" for name, a, s in pairs if s["train_s"])
        + "."
    )
    s3 = [x for x in rows if x["store"] == "s3" and x.get("server_cpu_s") is not None]
    if s3:
        out += (
            " The S3 server's CPU time per run (the benchmark's process), which a real S3 would not take from "
            "these cores: "
            + ", ".join(f"{x['model']} {'async' if x['async'] else 'sync'} {x['server_cpu_s']:.1f} s" for x in s3)
            + "."
        )
    return out + "\n\n"


def _data(r: dict) -> str:
    out = (
        "## 8. Data: preparing a corpus, and reading it from S3 while training\n\n"
        "A generated JSON Lines corpus (4 files of made-up prose, Zipf-distributed words), tokenized with a "
        "byte-level BPE of 2,048 ids trained on its first file. *Plain loop*: the tokenizer's own batch encoding "
        "(`tokenizer(texts, add_special_tokens=False)`, 1,000 documents a batch) in one process with every core, "
        "the documents read beforehand (`benchmarks/baselines/tokenize_loop.py`). *prepare*: `python -m "
        "rayhybrid.prepare` on the same files and cores, on a local Ray it starts; its tokens per second are those "
        "of its reading, tokenizing and writing (its own log line), its wall time includes starting Ray and "
        "listing the input. Then dp2 trains on the prepared dataset from S3 (moto's server on 127.0.0.1, in the "
        "benchmark's process, on the same 2 cores): *wait share* is the slowest rank's time waiting for its "
        "samples over the step time, summed over the steps after the first two.\n\n"
    )
    out += _header(r)
    if "prepare" not in r:
        return out
    loop, prep = r["loop"], r["prepare"]
    out += _table(
        ["", "tokens", "seconds", "tokens/s", "vs plain loop"],
        [
            ["plain loop", f"{loop['tokens']:,}", _f(loop["seconds"], 1), f"{loop['tokens_per_s']:,.0f}", "1.00x"],
            [
                "prepare",
                f"{prep['tokens']:,}",
                f"{prep['tokens'] / prep['tokens_per_s']:.1f} (wall {prep['wall_s']:.1f})",
                f"{prep['tokens_per_s']:,.0f}",
                f"{r['prepare_vs_loop']:.2f}x",
            ],
        ],
    )
    out += (
        f"\nThe corpus: {r['megabytes']} MB. prepare wrote {prep['documents']:,} documents in {prep['shards']} shards"
    )
    out += f", tokenizing with {prep['actors'].strip()}.\n\n" if prep.get("actors") else ".\n\n"
    out += _table(
        ["training from S3", "wait share", "median wait (ms)", "median step (s)", "runs"],
        [
            [
                x["case"],
                _f(x["share"], 2, pct=True),
                _f(x["median_wait_ms"], 1),
                _f(x["median_step_s"], 3),
                str(x["runs"]),
            ]
            for x in r["rows"]
        ],
    )
    return out + "\n"


SECTIONS = {
    "scaling": _scaling,
    "overhead": _overhead,
    "startup": _startup,
    "recovery": _recovery,
    "batch_search": _batch_search,
    "schedules": _schedules,
    "checkpoints": _checkpoints,
    "data": _data,
}


KEPT_HEADING = "## Figures from development runs"
"""A section of BENCHMARKS.md that results.json does not hold (figures measured by hand while
rayhybrid was developed): a rerun keeps it as it is."""


def kept_section(previous: str) -> str:
    """The KEPT_HEADING section of `previous` (an earlier BENCHMARKS.md), verbatim from its
    heading to the next "## " heading or the end; "" when it has none."""
    lines = previous.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == KEPT_HEADING), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "".join(lines[start:end])


def markdown(results: dict, previous: str = "") -> str:
    """BENCHMARKS.md: a section per benchmark in `results`, then the kept section of `previous`."""
    sections = "".join(SECTIONS[name](results[name]) for name in SECTIONS if name in results)
    return INTRO + "\n" + sections + kept_section(previous)


def write(path: Path, results: dict) -> None:
    """Rewrite `path` (BENCHMARKS.md) from `results`, keeping its hand-written section."""
    previous = path.read_text() if path.exists() else ""
    path.write_text(markdown(results, previous))


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
                f"{name:13s} "
                + ", ".join(f"{k} {_f(c.get('kill_to_next_step_s'), 1)}s" for k, c in r["cases"].items())
                + f", Ray Train {_f(r['raytrain'].get('kill_to_first_step_s'), 1)}s"
            )
        elif name == "batch_search":
            lines.append(
                f"{name:13s} "
                + "  ".join(
                    f"{x['budget_mb']:.0f}MB {x['search']}: {x['trials']} trials {x['wall_s']:.0f}s -> {x['largest']}"
                    for x in r["rows"]
                )
            )
        elif name == "checkpoints":
            lines.append(
                f"{name:13s} blocked async/sync "
                + "  ".join(
                    f"{x['model']} {x['store']} {_f(x.get('blocked_vs_sync'), 3)}" for x in r["rows"] if x["async"]
                )
                + "; uploading/no-upload step "
                + "  ".join(
                    f"{x['model']} {x['store']} {_f(x['slowdown'])}x" for x in r["rows"] if x["async"] and x["slowdown"]
                )
            )
        elif name == "data":
            lines.append(
                f"{name:13s} prepare/plain loop {_f(r['prepare_vs_loop'])}x; wait share from S3 "
                + "  ".join(f"{x['case']} {_f(x['share'], pct=True)}" for x in r["rows"])
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
