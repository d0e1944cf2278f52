"""Checkpoints: what a save costs training, asynchronous against synchronous, into S3 (moto on
loopback) and onto local disk, for the tiny model and one about 100x larger."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import common
import s3
from figures import fmt, header, table

# About 100x the tiny default model's parameters (0.23M): 8 layers of d 512, 25M.
BIG_MODEL = ["model.n_layers=8", "model.d_model=512", "model.n_heads=8"]


def run(tmp: Path, quick: bool) -> dict:
    """What a checkpoint costs training, asynchronous (the default) against synchronous, into S3
    (moto's server on 127.0.0.1, in this process) and onto local disk, for the tiny default model
    and one about 100x larger; one rank, a save every few steps. Per run: the time blocked per
    save and the upload's time (checkpoint events), and step times while an upload is in flight
    against steps with none (see checkpoint_stats)."""
    # A save every `every` steps and at the last; the larger model's upload takes several steps.
    models = {
        "tiny": {"overrides": [], "steps": 20 if quick else 30, "every": 5},
        "8 x 512": {
            "overrides": [*BIG_MODEL, "train.global_batch_size=4", "train.micro_batch_size=4"],
            "steps": 20 if quick else 40,
            "every": 10,
        },
    }
    cases = [  # (model, store, async): async, sync; then sync, async: a slow spell favours neither
        (model, store, asynchronous)
        for m, model in enumerate(models)
        for s, store in enumerate(("local", "s3"))
        for asynchronous in ((True, False) if (m + s) % 2 == 0 else (False, True))
    ]
    rows = []
    # loopback_aws first: nothing started from here on can reach a real cloud.
    with s3.loopback_aws(), s3.moto_server() as endpoint:
        aws = {**s3.CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        s3.make_bucket("bench", endpoint)
        for i, (model, store, asynchronous) in enumerate(cases):
            name = f"{i}-{store}-{'async' if asynchronous else 'sync'}"
            where = f"s3://bench/{name}" if store == "s3" else str(tmp / f"ckpt-{name}")
            m = models[model]
            overrides = [
                *m["overrides"],
                f"train.steps={m['steps']}",
                f"checkpoint.every={m['every']}",
                "train.log_every=100",
                f"checkpoint.dir={where}",
                f"checkpoint.async_save={str(asynchronous).lower()}",
            ]
            load, cpu = os.getloadavg()[0], time.process_time()
            summary, _, _ = common.train(overrides, tmp / f"ckpt-run-{name}", extra_env=aws)
            cpu = time.process_time() - cpu  # this process's CPU: almost all moto's, serving S3
            rows.append(
                {
                    "model": model,
                    "params": summary["params"],
                    "store": store,
                    "async": asynchronous,
                    **checkpoint_stats(common.records_of(tmp / f"ckpt-run-{name}")),
                    "summary": summary["checkpoints"],
                    "train_s": summary["train_s"],
                    "load": [round(load, 2), round(os.getloadavg()[0], 2)],  # 1-minute load average, before/after
                    "server_cpu_s": round(cpu, 2),
                }
            )
    for row in rows:
        if row["async"]:
            (sync,) = [x for x in rows if (x["model"], x["store"], x["async"]) == (row["model"], row["store"], False)]
            row["blocked_vs_sync"] = (
                row["blocked_s"] / sync["blocked_s"] if row["blocked_s"] and sync["blocked_s"] else None
            )
    return {"rows": rows, "models": models}


def checkpoint_stats(records: list[dict], warmup: int = 2) -> dict:
    """One run's checkpoint costs, from its metrics.jsonl records in order.

    A save of step s starts right after step s's record; its commit is recorded ("checkpoint"
    event, or "checkpoint_failed") after the record of the first step that ended with the upload
    done, or at the next save, which waits for it. The steps in between ran with the upload in
    flight (the last of them perhaps only in part); a synchronous save's event comes before the
    next step, so it has none. Steps 1..`warmup` count in neither group."""
    saves = [r for r in records if r.get("event") == "checkpoint"]
    failed = [r for r in records if r.get("event") == "checkpoint_failed"]
    saved_at = {r["step"] for r in saves + failed}
    inflight: set[int] = set()
    uploading, quiet, after_save, pauses, gaps = [], [], [], [], []
    last, outlasted = None, 0
    for r in records:
        if r.get("event") in ("checkpoint", "checkpoint_failed"):
            inflight.discard(r["step"])
            # Reported after the next save's step: the upload took the whole interval, and the
            # next save may have waited for it (within its time blocked).
            outlasted += last is not None and last["step"] != r["step"] and last["step"] in saved_at
        elif "event" not in r:
            k = r["step"]
            if k > warmup:
                (uploading if inflight else quiet).append(r["step_time_s"])
                if k - 1 in saved_at:
                    after_save.append(r["step_time_s"])
                if last is not None:  # the driver's wall between two step records, less the step
                    (pauses if k - 1 in saved_at else gaps).append(r["time"] - last["time"] - r["step_time_s"])
            if k in saved_at:
                inflight.add(k)
            last = r

    def median(xs):
        return statistics.median(xs) if xs else None

    pause, gap = median(pauses), median(gaps)
    return {
        "saves": len(saves),
        "failed": [f"step {r['step']}: {r['error']}" for r in failed],
        "blocked_s": median([r["blocked_s"] for r in saves]),
        "upload_s": median([r["upload_s"] for r in saves]),
        "blocked_all_s": [r["blocked_s"] for r in saves],
        "upload_all_s": [r["upload_s"] for r in saves],
        # The wall time the driver saw a save add between two steps (save call less a step's usual call)
        "driver_pause_s": pause - gap if pause is not None and gap is not None else None,
        "outlasted": outlasted,
        "after_save_s": median(after_save),
        "uploading_steps": len(uploading),
        "uploading_s": median(uploading),
        "quiet_steps": len(quiet),
        "quiet_s": median(quiet),
        "quiet_quartiles_s": statistics.quantiles(quiet, n=4) if len(quiet) >= 2 else None,
        "slowdown": median(uploading) / median(quiet) if uploading and quiet else None,
    }


def section(r: dict) -> str:
    """Its section of BENCHMARKS.md."""
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
    out += header(r)
    if "rows" not in r:
        return out

    def steps(n, x):
        return f"{n}: {fmt(x, 3)}" if n else "-"

    out += table(
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
                fmt(x["blocked_s"], 3),
                fmt(x["upload_s"], 3),
                fmt(x.get("blocked_vs_sync"), 3) if x["async"] else "",
                fmt(x["driver_pause_s"], 3),
                fmt(x["after_save_s"], 3),
                steps(x["uploading_steps"], x["uploading_s"]),
                steps(x["quiet_steps"], x["quiet_s"]),
                fmt(x["slowdown"]) + "x" if x["slowdown"] else "-",
                fmt(x["train_s"], 1),
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
            f"{'/'.join(fmt(q, 3) for q in x['quiet_quartiles_s'] or [])}, load {x['load'][0]:.1f} -> {x['load'][1]:.1f}"
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


def summary(r: dict) -> str:
    """Its line of the printed table (after its name): the figures that matter."""
    return (
        "blocked async/sync "
        + "  ".join(f"{x['model']} {x['store']} {fmt(x.get('blocked_vs_sync'), 3)}" for x in r["rows"] if x["async"])
        + "; uploading/no-upload step "
        + "  ".join(
            f"{x['model']} {x['store']} {fmt(x['slowdown'])}x" for x in r["rows"] if x["async"] and x["slowdown"]
        )
    )
